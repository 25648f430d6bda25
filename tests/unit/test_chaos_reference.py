"""The uninterrupted reference run (``slurmft.chaos.reference``, the demo's, the soak's and the
integration tests'): its ranks forked warm from torchrun's agent as a job's are, the server's
directory removed at the end, and a run past its bound killed whole, warm ranks included (they
run in sessions of their own). Real torchrun, warm server and gloo ranks of examples/train_gpt.py.
That warm and cold ranks train the same losses is the integration tests' to show: the
in-allocation shrink case's job runs cold (``SLURMFT_WARM_WORKERS=0``) against this reference."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from procs import wait_until
from slurmft.chaos.reference import ReferenceRunError, uninterrupted_run
from slurmft.journal import LOSS
from slurmft.launch import warmtask
from slurmft.slurm.devcluster.procs import read_environ, snapshot

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
ENV = {"OMP_NUM_THREADS": "1", "SLURMFT_PYTHON": sys.executable}
FORKED = re.compile(r"slurmft warm server\[\d+\]: rank (\d) \(attempt 0\) forked warm")

pytestmark = pytest.mark.timeout(300)


def _processes_of(run_dir: Path) -> list[int]:
    """Live processes whose environment names ``run_dir`` (the agent, the server, the ranks)."""
    found = []
    for st in snapshot():
        if st.state == "Z" or st.pid == os.getpid():
            continue
        if read_environ(st.pid).get("SLURMFT_RUN_DIR") == str(run_dir):
            found.append(st.pid)
    return found


def test_the_ranks_are_forked_warm_and_nothing_is_left_behind(tmp_path):
    run_dir = tmp_path / "reference"
    events = uninterrupted_run(run_dir, EXAMPLE, ["--tiny", "--steps", "6", "--global-batch", "12"],
                               2, env={**ENV, "TMPDIR": str(tmp_path)}, timeout=240)
    assert [e.get("step") for e in events if e.kind == LOSS] == list(range(1, 7))
    log = (tmp_path / "reference.log").read_text()
    assert sorted(int(r) for r in FORKED.findall(log)) == [0, 1], log[-3000:]
    assert "starting this rank cold" not in log
    assert not list(tmp_path.glob(f"{warmtask.DIR_PREFIX}*"))  # the server's directory, released
    assert _processes_of(run_dir) == []


def test_a_run_past_its_bound_is_killed_warm_ranks_and_all(tmp_path):
    run_dir = tmp_path / "reference"
    # Each step sleeps 60 s: the run cannot end within its 20 s bound, its rank is mid-step.
    with pytest.raises(ReferenceRunError, match="did not finish within 20 s"):
        uninterrupted_run(run_dir, EXAMPLE, ["--tiny", "--steps", "5", "--step-sleep", "60"], 1,
                          env={**ENV, "TMPDIR": str(tmp_path)}, timeout=20)
    assert FORKED.search((tmp_path / "reference.log").read_text())
    wait_until("the reference run's processes to end", lambda: not _processes_of(run_dir), 60)
    assert not list(tmp_path.glob(f"{warmtask.DIR_PREFIX}*"))
