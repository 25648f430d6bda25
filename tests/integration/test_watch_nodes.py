"""Nodes under ``slurmft watch`` on the devcluster: an admin's drain of a node of a running job is
maintenance, waited out until the job's next checkpoint commits, then the job is requeued without
the node and no step is lost; on a cluster with two partitions, the watcher's own exclusion of a
repaired node is lifted when the job no longer fits its partition (the other partition's idle
nodes are no capacity for it)."""

from __future__ import annotations

import atexit
import os
import subprocess
from typing import Iterator

import pytest

from slurmft.slurm.client import JobState
from slurmft.slurm.devcluster import DevCluster, DevClusterError
from slurmft.slurm.devcluster.release import Binaries

from test_watch_recovery import _committed, _context, _start
from train_job_support import TINY_ARGS, losses
from watch_support import events_until, observe_until, of

pytestmark = pytest.mark.integration


def scontrol(cluster: DevCluster, *args: str) -> None:
    done = subprocess.run(["scontrol", *args], env={**cluster.env}, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, f"scontrol {' '.join(args)}: {done.stderr}"


@pytest.fixture
def partitioned_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """Its own 3-node cluster: partition ``train`` (n1, n2; the default) beside ``other`` (n3)."""
    if os.geteuid() != 0:
        pytest.skip("no devcluster on this machine: devcluster needs root")
    try:
        Binaries.find()
    except DevClusterError as exc:
        pytest.skip(f"no devcluster on this machine: {exc}")
    cluster = DevCluster.up(tmp_path_factory.mktemp("parts"), nodes=3,
                            partitions={"train": ["n1", "n2"], "other": ["n3"]})

    def stop() -> None:
        if cluster.is_running():
            cluster.down()

    atexit.register(stop)
    try:
        yield cluster
    finally:
        stop()
        atexit.unregister(stop)


@pytest.mark.timeout(420)
def test_an_admin_drain_waits_for_the_next_checkpoint_and_loses_no_step(slurm_cluster, tmp_path):
    steps = 120
    args = [*TINY_ARGS, "--steps", str(steps), "--ckpt-every", "20", "--step-sleep", "0.2"]
    # One node, drained: the watcher's rule is the same for any node of any job (issue 28: each
    # node of each of the two segments is a torchrun and a rank importing torch).
    run, job, watcher = _start(slurm_cluster, tmp_path, args, nodes=1, name="admin_drain")
    ctx = _context(job, watcher)
    try:
        events_until(run, lambda ev: 20 in _committed(ev), 180, "first checkpoint", context=ctx)
        [victim] = job.client.job(job.job_id).nodes
        scontrol(slurm_cluster, "update", f"nodename={victim}", "state=drain", "reason=maintenance")
        # The watcher says it waits, and acts only once a checkpoint committed after the drain.
        # Maintenance, not a fault: journaled as a planned end, its actions as restart actions.
        events = events_until(run, lambda ev: of(ev, "planned_end"), 120,
                              "the drain's recovery", context=ctx)
        [warned] = of(events, "watch_warning", what="node_drained")
        [fault] = of(events, "planned_end")
        assert fault.get("cause") == "node_drained" and fault.get("nodes") == [victim]
        after = [e for e in of(events, "checkpoint_committed") if e.time > warned.time]
        assert after and after[0].time <= fault.time, "requeued before a checkpoint after the drain"
        assert f"checkpoint step {after[0].get('step')} committed after the drain" in fault.get("evidence")
        assert watcher.wait(300) == 0, ctx()
        events = job.events()
        final = job.client.job(job.job_id)
        assert final.state is JobState.COMPLETED and final.restart_count == 1
        assert victim in final.excluded_nodes
        assert victim not in of(events, "job_running")[0].get("nodes")
        # Zero steps lost: the new segment restored the newest checkpoint the drained segment
        # committed (the one after the drain, or its emergency save on the requeue's SIGTERM),
        # and no step was trained twice.
        restored = of(events, "segment_start")[-1].get("restored_step")
        first = [e.get("step") for e in of(events, "checkpoint_committed") if e.get("restart_count") == 0]
        assert restored == max(first) and restored >= after[0].get("step"), (restored, first)
        trained = losses(events)  # asserts that no step was journaled twice
        assert sorted(trained) == list(range(1, steps + 1))
        assert len(of(events, "restart_action", action="requeue")) == 1
        assert not of(events, "fault_detected") and not of(events, "recovery_action")
    finally:
        watcher.kill()


@pytest.mark.timeout(420)
def test_a_repaired_exclusion_is_readmitted_when_the_job_no_longer_fits_its_partition(
        partitioned_cluster, tmp_path):
    """The sweeper drains n1 of a 2-node job in ``train``: the watcher requeues it excluding n1.
    n1 is repaired (resumed): the job, excluded from half its partition, can never start, however
    idle ``other`` is, until the watcher takes n1 out of its ExcNodeList again."""
    cluster = partitioned_cluster
    args = [*TINY_ARGS, "--steps", "60", "--ckpt-every", "10", "--step-sleep", "0.1"]
    run, job, watcher = _start(cluster, tmp_path, args, nodes=2, name="partitions")
    ctx = _context(job, watcher)
    try:
        assert job.client.job(job.job_id).partitions == frozenset({"train"})
        events_until(run, lambda ev: 10 in _committed(ev), 180, "first checkpoint", context=ctx)
        scontrol(cluster, "update", "nodename=n1", "state=drain", "reason=slurmft: test: bad disk")
        events_until(run, lambda ev: of(ev, "recovery_action", action="exclude", ok=True), 120,
                     "n1 excluded", context=ctx)
        observe_until(job.client, job.job_id, lambda j: "n1" in j.excluded_nodes
                      and j.state is JobState.PENDING, 60, "pending without n1", context=ctx)
        scontrol(cluster, "update", "nodename=n1", "state=resume")
        events = events_until(run, lambda ev: of(ev, "job_running"), 180, "running again",
                              context=ctx)
        [readmit] = of(events, "recovery_action", action="readmit")
        assert readmit.get("nodes") == ["n1"] and readmit.get("ok")
        assert sorted(of(events, "job_running")[0].get("nodes")) == ["n1", "n2"]
        assert watcher.wait(240) == 0, ctx()
        assert job.client.job(job.job_id).state is JobState.COMPLETED
    finally:
        watcher.kill()
