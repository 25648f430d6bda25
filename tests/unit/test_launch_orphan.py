"""The batch host's death seen from the other nodes' tasks (in-allocation mode): its beat judged
on this node's clock, the stagger, and the requeue asked for when it is gone."""

import json
import os
import signal
import sys

import pytest

from launch_envs import recorded
from slurmft import journal
from slurmft.journal import read_events
from slurmft.launch import orphan
from slurmft.rundir import RunDir

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def _beat(path, seq, **extra):
    path.write_text(json.dumps({"seq": seq, "pid": 9, "step_id": "1", **extra}))


def test_the_batch_host_counts_as_dead_after_its_silence_plus_this_nodes_stagger(tmp_path):
    path, clock = tmp_path / "n1.json", Clock()
    _beat(path, 1)  # there before: not a beat of this run
    watch = orphan.BatchWatch(path, silent_s=10, place=2, clock=clock)
    clock.now += orphan.STARTUP_S - 1
    assert watch.silent_s() is None  # no beat yet: the start-up grace
    _beat(path, 2)
    assert watch.silent_s() is None
    clock.now += 10 + 2 * orphan.STAGGER_S - 0.5
    assert watch.silent_s() is None
    clock.now += 1
    assert watch.silent_s() == pytest.approx(10 + 2 * orphan.STAGGER_S + 0.5)


def test_a_batch_task_that_ended_by_itself_is_no_death(tmp_path):
    path, clock = tmp_path / "n1.json", Clock()
    watch = orphan.BatchWatch(path, silent_s=5, place=0, clock=clock)
    _beat(path, 1 << 40, ended=0)
    clock.now += 1000
    assert watch.silent_s() is None


def test_only_a_step_the_launcher_told_watches(tmp_path):
    assert orphan.from_environ({}) is None
    env = orphan.environ_for("n1", tmp_path / "n1.json", 10, 1)
    watch = orphan.from_environ(env)
    assert watch is not None and watch.bound == 10 + orphan.STAGGER_S


def test_the_job_is_requeued_excluding_the_batch_host(tmp_path, monkeypatch):
    env = {**recorded("nonarray"), "SLURMD_NODENAME": "n2", "SLURMFT_RUN_DIR": str(tmp_path),
           "PATH": str(tmp_path / "no-slurm-here"), orphan.BATCH_NODE_ENV: "n1"}
    assert orphan.requeue_job(env, 12.5) == 85
    [asked] = read_events(RunDir(tmp_path).events, [journal.REQUEUE_REQUEST])
    assert asked.get("exclude") == ["n1"] and "the batch host n1 died" in asked.get("reason")


def test_a_task_whose_batch_host_goes_silent_requeues_and_stops_its_torchrun(tmp_path, monkeypatch):
    from slurmft.launch import task

    batch = tmp_path / "alive" / "n1.json"
    batch.parent.mkdir()
    monkeypatch.setattr(orphan, "STARTUP_S", 0.5)
    monkeypatch.setattr(orphan, "POLL_S", 0.1)
    asked = []
    monkeypatch.setattr(orphan, "FILE_ALONE_S", 0.5)
    monkeypatch.setattr(orphan, "requeue_job", lambda env, silent, detail: asked.append(silent))
    for key, value in orphan.environ_for("n1", batch, 0.5, 0).items():
        monkeypatch.setenv(key, value)
    code = "import time; time.sleep(60)"
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = task.supervise([sys.executable, "-c", code], tmp_path / "alive" / "n2.json")
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert asked and rc == 128 + 15  # TERM, passed on to the child
    assert os.path.exists(tmp_path / "alive" / "n2.json")


# -- a spare's task waits, started, until the launcher makes it active ---------------------------

def test_a_spares_task_starts_torchrun_only_once_the_allocation_makes_it_active(tmp_path, monkeypatch):
    import threading
    import time

    from slurmft import allocation
    from slurmft.launch import spare, task
    from slurmft.launch.allocation import fence, initial

    run = RunDir(tmp_path)
    first = initial("7", ("n1", "n2"), ("n3",), 2)
    allocation.write(run, first)
    monkeypatch.setenv("SLURMFT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("SLURMFT_JOB_ID", "7")
    monkeypatch.setenv(spare.SPARE_ENV, "n3")
    mark = tmp_path / "started"
    code = f"open({str(mark)!r}, 'w').close()"
    before = []

    def promote() -> None:
        time.sleep(2 * spare.POLL_S + 0.5)
        before.append((mark.exists(), run.alive("n3").exists()))
        allocation.write(run, fence(first, "n2", "node_silent", 1.0, ["x"], "n3"))

    thread = threading.Thread(target=promote)
    thread.start()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = task.supervise([sys.executable, "-c", code], run.alive("n3"))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    thread.join(30)
    assert before == [(False, True)]  # beating, no torchrun yet
    assert rc == 0 and mark.exists()


def test_a_spare_stopped_while_it_waits_ends_without_starting_torchrun(tmp_path):
    import threading

    from slurmft import allocation
    from slurmft.launch import spare
    from slurmft.launch.allocation import initial

    allocation.write(RunDir(tmp_path), initial("7", ("n1",), ("n2",), 1))
    stop = threading.Event()
    stop.set()
    assert spare.wait_until_active(tmp_path, "n2", {"7"}, stop, poll_s=0.01) is False
    # another job's record, or one that does not check, is no reason to start
    allocation.write(RunDir(tmp_path), initial("8", ("n2",), (), 1))
    assert spare.wait_until_active(tmp_path, "n2", {"7"}, stop, poll_s=0.01) is False
    RunDir(tmp_path).allocation.write_text("[")
    assert spare.wait_until_active(tmp_path, "n2", {"7"}, stop, poll_s=0.01) is False
    allocation.write(RunDir(tmp_path), initial("7", ("n1", "n2"), (), 1))
    assert spare.wait_until_active(tmp_path, "n2", {"7"}, stop, poll_s=0.01) is True
