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
