"""``make demo`` as a test, so that it cannot rot: examples/demo.py end to end on its own 4-node
devcluster beside the session's (every fault recovered by the real watcher, the status and its
PNG, the comparison with an uninterrupted run; then a node death recovered by a hot spare inside
the allocation, issue 27: the job never requeued, its losses bit for bit), and a Ctrl-C in the middle of it that leaves no
process, no /etc/hosts line and no devcluster behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slurmft.slurm.devcluster.hosts import HOSTS_FILE, parse_blocks
from slurmft.slurm.devcluster.procs import read_environ, snapshot

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.py"
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")}, "PYTHONUNBUFFERED": "1"}


def processes_of(demo_dir: Path) -> list[str]:
    """Live processes that name the demo's dir in their command line or environment (the
    daemons, the job's processes, the watcher: all carry SLURM_CONF or paths under it)."""
    found = []
    mark = str(demo_dir)
    for st in snapshot():
        if st.state == "Z" or st.pid == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{st.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if mark in cmdline or any(mark in v for v in read_environ(st.pid).values()):
            found.append(f"{st.pid}: {cmdline[:200]}")
    return found


def cluster_blocks() -> set[str]:
    _, blocks = parse_blocks(HOSTS_FILE.read_text())
    return {b.cluster for b in blocks}


def _left_behind(demo_dir: Path, name: str) -> None:
    deadline = time.monotonic() + 15  # a killed process may take a moment to be reaped
    while processes_of(demo_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_of(demo_dir) == []
    assert name not in cluster_blocks()
    assert not (demo_dir / "cluster" / "devcluster.json").exists()


@pytest.fixture
def demo_dir():
    # A short path: slurmstepd's socket lies under the cluster dir (sun_path is 108 bytes), and
    # pytest's tmp_path under an xdist worker made it too long: every launch failed, the job was
    # held and the demo waited in vain (the devcluster now refuses such a dir at once).
    top = Path(tempfile.mkdtemp(prefix="demo", dir="/tmp"))
    yield top / "demo"
    shutil.rmtree(top, ignore_errors=True)


# A liveness bound, not a budget (benchmarks/demo_bench.py times it): ~7 min on a quiet 2-core box,
# over 14 min beside four engineers' tests (load 29), where the old 840 s bound killed it; the
# spare part (a second job, issue 27) adds ~3-4 min at load 12-29.
@pytest.mark.timeout(1860)
def test_demo_recovers_every_fault_and_leaves_nothing_behind(demo_dir):
    res = subprocess.run([sys.executable, str(DEMO), "--dir", str(demo_dir)], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=1800, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "demo passed" in out
    for fault in ("node death", "hang", "crash", "corrupted checkpoint", "time limit",
                  "failing health check"):
        assert re.search(rf"fault \d: {fault} after checkpoint \d+", out), fault
    # Each detected as the watcher should, recovered by it, and the run back on 2 ranks.
    for cause in ("node_fail|node_down", "hang", "crash", "preempted", "node_unhealthy"):
        assert re.search(rf"detected as ({cause}) after", out), cause
    assert "bit for bit" in out and "every step saw the same samples: yes" in out
    assert "ETTR" in out and "timeline written to" in out  # slurmft status and its PNG
    # The spare part: in the allocation (restart count 0, still RUNNING), shown beside the requeue,
    # its 40 steps' losses those of the uninterrupted run.
    assert re.search(r"detected as (node_silent|node_death) after [\d.]+ s, training again after "
                     r"[\d.]+ s from step \d+ on 2 ranks", out), out[-6000:]
    assert "the job: RUNNING, restart count 0 (recovered inside its allocation)" in out
    assert "hot spare (in the allocation)" in out and "requeue (slurmft watch)" in out
    assert "80 steps trained on 2 ranks: 80 have the loss of the uninterrupted run bit for bit" in out
    assert "40 steps trained on 2 ranks: 40 have the loss of the uninterrupted run bit for bit" in out
    assert "in the allocation: a node death recovered by a hot spare, the job never requeued" in out
    # Its time is a figure, not a behaviour: printed here (pytest -rP shows it), kept by
    # benchmarks/demo_bench.py against the README's promise.
    took = re.search(r"demo passed in (\d+) s", out)
    assert took, "the demo printed no time"
    print(f"the demo took {took.group(1)} s")
    assert (demo_dir / "timeline.png").stat().st_size > 10_000
    name = re.search(r"devcluster (sft[0-9a-f]+)", out).group(1)
    _left_behind(demo_dir, name)


@pytest.mark.timeout(600)
def test_ctrl_c_in_the_middle_of_the_demo_tears_everything_down(tmp_path, demo_dir):
    log = tmp_path / "demo.out"
    with open(log, "wb") as fh:
        # Its own process group, signalled as a whole: what Ctrl-C in a terminal does.
        proc = subprocess.Popen([sys.executable, str(DEMO), "--dir", str(demo_dir)], cwd=REPO,
                                env=ENV, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        events = demo_dir / "run" / "events.jsonl"
        deadline = time.monotonic() + 420  # the cluster's start, the job's pre-flight (180 s bound), torch on a loaded box
        # Interrupted once the job trains and the watcher watches: the most there is to clean.
        while not (events.exists() and '"kind":"loss"' in events.read_text()):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the demo's job never trained\n" + log.read_text()[-4000:]
            time.sleep(0.5)
        assert processes_of(demo_dir)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(120) == 130, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert "interrupted (SIGINT): tearing down" in out and "devcluster down" in out
    _left_behind(demo_dir, re.search(r"devcluster (sft[0-9a-f]+)", out).group(1))
