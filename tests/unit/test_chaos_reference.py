"""The uninterrupted reference run (``slurmft.chaos.reference``, the demo's, the soak's and the
integration tests'): its ranks forked warm from torchrun's agent as a job's are, the server's
directory removed at the end, and a run past its bound killed whole, warm or cold: its ranks run
in sessions of their own, outside torchrun's process group. Real torchrun, warm server and gloo
ranks of examples/train_gpt.py. That warm and cold ranks train the same losses is the
integration tests' to show: the in-allocation shrink case's job runs cold
(``SLURMFT_WARM_WORKERS=0``) against this reference."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from procs import wait_until
from slurmft.chaos import reference
from slurmft.chaos.reference import ReferenceRunError, uninterrupted_run
from slurmft.journal import LOSS
from slurmft.launch import warmtask
from slurmft.slurm.devcluster.procs import read_environ, snapshot

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
ENV = {"OMP_NUM_THREADS": "1", "SLURMFT_PYTHON": sys.executable}
FORKED = re.compile(r"slurmft warm server\[\d+\]: rank (\d) \(attempt 0\) forked warm")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def short_tmp(monkeypatch):
    """A TMPDIR short enough for the server's socket (under an xdist worker's tmp_path it would
    not fit and the server's directory would go to /tmp), and the directories made there."""
    top = tempfile.mkdtemp(prefix="ref", dir="/tmp")
    made: list[str] = []
    real = warmtask.make_dir

    def spy(env):
        path, fd = real(env)
        made.append(os.path.dirname(path))
        return path, fd
    monkeypatch.setattr(reference.warmtask, "make_dir", spy)
    yield top, made
    shutil.rmtree(top, ignore_errors=True)


def _processes_of(run_dir: Path) -> list[int]:
    """Live processes whose environment names ``run_dir`` (the agent, the server, the ranks)."""
    found = []
    for st in snapshot():
        if st.state == "Z" or st.pid == os.getpid():
            continue
        if read_environ(st.pid).get("SLURMFT_RUN_DIR") == str(run_dir):
            found.append(st.pid)
    return found


def test_the_ranks_are_forked_warm_and_nothing_is_left_behind(tmp_path, short_tmp):
    top, made = short_tmp
    run_dir = tmp_path / "reference"
    events = uninterrupted_run(run_dir, EXAMPLE, ["--tiny", "--steps", "6", "--global-batch", "12"],
                               2, env={**ENV, "TMPDIR": top}, timeout=240)
    assert [e.get("step") for e in events if e.kind == LOSS] == list(range(1, 7))
    log = (tmp_path / "reference.log").read_text()
    assert sorted(int(r) for r in FORKED.findall(log)) == [0, 1], log[-3000:]
    assert "starting this rank cold" not in log and "started cold" not in log
    assert len(made) == 1 and os.path.dirname(made[0]) == top  # the server's directory ...
    assert not os.path.exists(made[0])                          # ... released
    assert _processes_of(run_dir) == []


@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_run_past_its_bound_is_killed_whole(tmp_path, short_tmp, warm):
    top, made = short_tmp
    run_dir = tmp_path / "reference"
    # Each step sleeps 600 s: the run cannot end within its 40 s bound; its rank is mid-step
    # (started by then even on a loaded box: torch imported, forked or started cold).
    with pytest.raises(ReferenceRunError, match="did not finish within 40 s"):
        uninterrupted_run(run_dir, EXAMPLE, ["--tiny", "--steps", "5", "--step-sleep", "600"], 1,
                          env={**ENV, "TMPDIR": top, "SLURMFT_WARM_WORKERS": warm}, timeout=40)
    log = (tmp_path / "reference.log").read_text()
    if warm == "1":
        assert FORKED.search(log), log[-3000:]
        assert len(made) == 1 and not os.path.exists(made[0])
    else:
        assert "ranks started cold: SLURMFT_WARM_WORKERS=0" in log and made == []
    wait_until("the reference run's processes to end", lambda: not _processes_of(run_dir), 30)


def test_a_bad_warm_setting_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ReferenceRunError, match="SLURMFT_WARM_WORKERS='yes' must be 0 or 1"):
        uninterrupted_run(tmp_path / "reference", EXAMPLE, ["--tiny"], 1,
                          env={**ENV, "SLURMFT_WARM_WORKERS": "yes"}, timeout=40)
    assert not (tmp_path / "reference.log").exists()
