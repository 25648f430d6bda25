"""Integration tests: every ``slurmft watch`` a test started through ``TrainJob.watch`` is stopped
when the test ends, pass or fail."""

import pytest

from train_job_support import stop_watchers


@pytest.fixture(autouse=True)
def _stop_watchers():
    yield
    stop_watchers()
