"""``slurmft status`` at 80 columns (a pipe, a log, a small terminal): no header or value is
wrapped mid-word, and with more width nothing wraps at all. The run is the captured journal of a
real run with a preemption and a crash (tests/fixtures/journal/README.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "journal" / "preempt_crash.events.jsonl"


def status_through_cat(run: Path, columns: int) -> str:
    """``COLUMNS=N slurmft status RUN --no-slurm | cat``."""
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "xterm"}
    status = subprocess.Popen([sys.executable, "-m", "slurmft.cli", "status", str(run), "--no-slurm"],
                              stdout=subprocess.PIPE, env=env)
    cat = subprocess.run(["cat"], stdin=status.stdout, capture_output=True, text=True, timeout=60)
    assert status.stdout is not None
    status.stdout.close()
    assert status.wait(timeout=60) == 0 and cat.returncode == 0
    return cat.stdout


def words(text: str) -> list[str]:
    return [w for line in text.splitlines() for w in line.split() if set(w) - set("─━")]


@pytest.fixture
def run():
    # A short path: the report's first line names the run dir, and pytest's tmp_path under an
    # xdist worker (/tmp/pytest-of-root/pytest-N/popen-gwK/test_<name>0/run) alone passes 80
    # columns, which is about the path, not the layout under test.
    top = Path(tempfile.mkdtemp(prefix="w", dir="/tmp"))
    run = top / "run"
    run.mkdir()
    shutil.copyfile(FIXTURE, run / "events.jsonl")
    yield run
    shutil.rmtree(top, ignore_errors=True)


def test_at_80_columns_no_header_or_value_is_cut_mid_word(run):
    narrow = status_through_cat(run, 80)
    wide = status_through_cat(run, 300)
    assert all(len(line) <= 80 for line in narrow.splitlines())
    for header in ("#", "job.rst", "start", "ran", "nodes", "steps", "load", "ended", "cause", "at",
                   "seen", "requeue", "running", "back", "time"):
        assert header in narrow.split(), header
    # Every word the wide view prints is whole in the narrow one (a word folded over two lines
    # would be two other words), and in the same order.
    assert words(narrow) == words(wide)
    assert "#1 crash, steps 24->20: the job FAILED with exit None, signal 9" in narrow  # evidence below


def test_with_more_width_nothing_wraps(run):
    wide = status_through_cat(run, 300)
    assert "killed (no end recorded)" in wide
    assert any(line.startswith("warning ") and line.rstrip().endswith("newest step 9)")
               for line in wide.splitlines())


def test_node_lists_are_compressed_and_a_name_hostlist_refuses_is_shown_as_it_is():
    from slurmft.status.render import nodes

    assert nodes(["gpu02", "gpu01", "gpu10"]) == "gpu[01-02,10]"
    assert nodes(["a[b", "n1"]) == "a[b,n1"  # the run dir's content is untrusted: never a crash
    assert nodes([]) == "-"


LUSTRE = "/lustre/fsw/portfolios/llm/users/someone/projects/nanogpt-experiments"
# Issue 30's two lines under the segments table. Both events are real lines, re-keyed to the
# fixture's job 1 and its requeue 1, with their paths moved to where a real cluster keeps them:
# checkpoint_skipped from tests/unit/test_run_local.py::test_a_corrupted_newest_checkpoint_is_journaled_and_shown_by_status
# (a flipped byte in the newest shard), resume_diverged from /work/reports/review30_late_draw.py
# resumed after a preemption (2026-11-26, this repo at d4c2eca); "RUN" is the run dir.
ISSUE30_EVENTS = [
    {"job_id": "1", "kind": "checkpoint_skipped", "restart_count": 1, "step": 6, "t": 1795552808.1, "v": 1,
     "reason": "RUN/checkpoints/step_000000006/__0_0.distcp: wrong checksum 5d7a6ad435662229721cf256dceb10cb, "
               "manifest says 53ff6e8448686df23e9598859fa91302"},
    {"job_id": "1", "kind": "resume_diverged", "restart_count": 1, "step": 8, "t": 1795552809.2, "v": 1,
     "cause": "rng_before_loop", "site": f"{LUSTRE}/train.py:271",
     "message": "the global random state at the start of step 7 is not the one checkpoint 6 saved: something drew "
                f"from it between the restore and the loop (at {LUSTRE}/train.py:271 (torch), between "
                f"{LUSTRE}/train.py:262 and {LUSTRE}/train.py:280), e.g. a batch drawn before the loop, which the "
                "interrupted run drew from another state. Draw each step's batch inside the step (or from "
                "run.rng(step)). Step 8 is the first step that draws from that random state, so the resumed run "
                "differs from there on."},
]


def test_at_80_columns_the_skipped_checkpoint_and_the_divergence_are_not_cut_mid_word(run):
    import json

    with open(run / "events.jsonl", "a") as f:
        for event in ISSUE30_EVENTS:
            line = json.dumps(event).replace("RUN/", f"{run}/")
            f.write(line + "\n")
    narrow = status_through_cat(run, 80)
    wide = status_through_cat(run, 300)
    assert all(len(line) <= 80 for line in narrow.splitlines()), narrow
    assert words(narrow) == words(wide)
    flat = " ".join(narrow.split())
    # inside the run dir: relative to it; elsewhere: the last directory and the file
    assert ("checkpoint skipped segment 1 (1.1): step 6 at load: checkpoints/step_000000006/__0_0.distcp: "
            "wrong checksum") in flat, narrow
    assert ("resume diverged segment 1 (1.1): step 8 (rng_before_loop) at .../nanogpt-experiments/train.py:271: "
            "the global random state") in flat, narrow
    assert "between .../nanogpt-experiments/train.py:262 and" in flat, narrow
