"""A node whose Prolog fails (issue 25: "What Slurm holds, the watcher recovers ... a failed launch
or prolog"), on a devcluster of the test's own whose slurm.conf names a ``Prolog=`` that exits 1
on n2 (``DevCluster.up(prolog=...)``; a slurm.conf setting, so not the worker's shared cluster).

Measured on 22.05.8 (tests/fixtures/slurm/2205/README.md): a 2-node job placed on n1 and n2 runs
its batch script on n1; its first step's launch runs the prolog on n2, which fails: Slurm drains
n2 ("Prolog error"), requeues the job held ("launch failed requeued held", restart 1) and kills
the batch script on n1, so accounting's batch step names the healthy n1. The real
``slurmft watch`` excludes n2 (the node Slurm drained for the prolog, never the batch host),
releases the job, and the run trains on n1 and n3. The test only breaks n2 and observes."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from slurmft.slurm.client import JobState
from slurmft.slurm.devcluster import DevCluster, DevClusterError

from train_job_support import TINY_ARGS, submit
from watch_support import events_until, observe_until, of

pytestmark = pytest.mark.integration
BAD = "n2"
PROLOG = f"""#!/bin/sh
# A node whose prolog finds it broken (a site health check, a mount that is missing): {BAD}.
[ "$SLURMD_NODENAME" = "{BAD}" ] && exit 1
exit 0
"""


@pytest.fixture
def prolog_cluster() -> Iterator[DevCluster]:
    # A short directory: munged's and the slurmstepds' sockets live under it.
    root = Path(tempfile.mkdtemp(prefix="sft-prolog-", dir="/tmp"))
    prolog = root / "prolog"
    prolog.write_text(PROLOG)
    prolog.chmod(0o755)
    cluster = None
    try:
        cluster = DevCluster.up(root / "c", nodes=3, prolog=str(prolog), timeout=300)
        yield cluster
    finally:
        if cluster is not None:
            try:
                cluster.down()
            except DevClusterError as exc:
                print(f"prolog cluster teardown: {exc}")
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(480)
def test_a_node_whose_prolog_fails_is_excluded_and_the_job_runs_elsewhere(prolog_cluster, tmp_path):
    cluster = prolog_cluster
    run = tmp_path / "run"
    run.mkdir()
    submitted = time.monotonic()
    job = submit(cluster, run, [*TINY_ARGS, "--steps", "6", "--step-sleep", "0.1"], nodes=2,
                 sbatch_options=[f"--comment=SLURMFT_RUN_DIR={run}"], watch=True)
    ctx = job.context
    events = events_until(run, lambda ev: of(ev, "job_running"), 300,
                          "the job running again after its failed prolog", context=ctx)
    running_s = time.monotonic() - submitted
    events = events_until(run, lambda ev: of(ev, "loss"), 240, "training on other nodes",
                          context=ctx)
    print(f"\nprolog failed on {BAD}: running elsewhere {running_s:.0f} s after submission, "
          f"first loss after {time.monotonic() - submitted:.0f} s")
    [fault] = of(events, "fault_detected")
    # The node reported is the one whose prolog failed, not the batch host (n1) that
    # accounting's batch step names.
    assert fault.get("cause") == "launch_failed" and fault.get("nodes") == [BAD], fault.fields
    assert "Prolog error" in fault.get("evidence"), fault.fields
    assert of(events, "recovery_action", action="release", ok=True), ctx()
    ran_on = of(events, "job_running")[0].get("nodes")
    assert BAD not in ran_on and len(ran_on) == 2, ran_on
    live = job.state()
    assert BAD in live.excluded_nodes and "n1" not in live.excluded_nodes, live
    assert live.restart_count == 1, live
    # What Slurm itself did to the node: drained it, with the reason an admin reads.
    node = cluster.nodes()[BAD]
    assert "DRAIN" in node.flags and node.reason.startswith("Prolog error"), node.describe()
    final = observe_until(job.client, job.job_id, lambda j: j.state.finished, 240, "end", context=ctx)
    assert final.state is JobState.COMPLETED, ctx()
