"""The batch host's death seen from the other nodes' tasks (in-allocation mode): its beat judged
on this node's clock, the stagger, and the requeue asked for when it is gone."""

import json
import os
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
    watch = orphan.BatchWatch(path, silent_s=5, place=2, clock=clock)
    clock.now += orphan.STARTUP_S - 1
    assert watch.silent_s() is None  # no beat yet: the start-up grace
    _beat(path, 2)
    assert watch.silent_s() is None
    clock.now += 5 + 2 * orphan.STAGGER_S - 0.5
    assert watch.silent_s() is None
    clock.now += 1
    assert watch.silent_s() == pytest.approx(5 + 2 * orphan.STAGGER_S + 0.5)


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
    monkeypatch.setattr(orphan, "requeue_job", lambda env, silent: asked.append(silent))
    for key, value in orphan.environ_for("n1", batch, 0.5, 0).items():
        monkeypatch.setenv(key, value)
    code = "import time; time.sleep(60)"
    rc = task.supervise([sys.executable, "-c", code], tmp_path / "alive" / "n2.json")
    assert asked and rc == 128 + 15  # TERM, passed on to the child
    assert os.path.exists(tmp_path / "alive" / "n2.json")
