"""examples/train_gpt.py ends without the interpreter's last garbage collections over torch's
objects (``gc.freeze()`` once ``main`` is done: ~0.7 CPU-s less per rank, every rank of every
start), and that loses nothing: the run is complete in its journal and the exit status is 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmft.journal import LOSS, read_events
from slurmft.rundir import RunDir

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.mark.timeout(300)
def test_train_gpt_freezes_the_heap_before_the_interpreter_ends_and_loses_nothing(tmp_path):
    # An atexit hook registered before the script's own runs after them, just before the
    # interpreter's last collections: it says whether they will walk the script's objects.
    code = ("import atexit, gc, runpy, sys\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0, flush=True))\n"
            f"sys.argv = [{str(SCRIPT)!r}, '--tiny', '--steps', '2']\n"
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")},
           "SLURMFT_RUN_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "frozen at exit: True" in proc.stdout, proc.stdout[-2000:]
    run = RunDir(tmp_path / "run")
    assert run.done.exists()
    assert sorted(e.get("step") for e in read_events(run.events) if e.kind == LOSS) == [1, 2]
