"""In-allocation recovery on the real devcluster (issue 27): a 3-node job (2 active + 1 hot
spare, ``sbatch --no-kill``) whose non-batch node is killed goes on inside its allocation, on
the spare, without leaving RUNNING, every step's loss bit-identical to an uninterrupted run's,
and the spare, whose beat file stalls meanwhile, is neither dropped nor fenced (its TCP beats go
on); with ``SLURMFT_SPARE_REFILL=1`` a spare job on the cluster's fourth node then replaces the
used spare and takes a second dead node's place the same way; without a spare the world shrinks
from 3 to 2 nodes at the same global sample. The world's size does not matter to a spare's
take-over before Slurm's DOWN, a preemption or the batch host's death either: each is 2 active +
1 spare (issue 28: 3 + 1 before; each node is a torchrun, a warm server and a rank). A rank's
crash, restarted in place, keeps 3 + 1: the one 3-rank world that is re-formed and compared bit
for bit (with 3 ranks a reduction's order shows in the last bits).

Ranks are forked from each node's warm server, the default in this mode: the spare and rank-crash
cases assert it (every rank of every world forked warm, none cold); the shrink case opts out
(``SLURMFT_WARM_WORKERS=0``) and checks the cold path. Issue 28 merged into the spare case, which
runs under the real ``slurmft watch`` in operator mode, two tests that started the same job:
test_watch_inalloc.py's test_the_watcher_leaves_a_recovery_in_the_allocation_alone and
test_inalloc_warm.py's test_a_spare_replaces_a_killed_node_with_warm_workers; into the rank-crash
case, test_inalloc_warm.py's test_a_warm_rank_killed_9_is_restarted_in_place."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmft import exitcodes, journal
from slurmft.launch import agent, warm
from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import JobState

from train_job_support import TINY_ARGS, TrainJob, reference_losses, submit
from watch_support import WatcherProc

pytestmark = pytest.mark.integration

ARGS = [*TINY_ARGS, "--steps", "40", "--ckpt-every", "5", "--step-sleep", "0.2"]
# A 4 s silence bound keeps the test short (the default is 5 s).
INALLOC_ENV = {"SLURMFT_NODE_SILENT_S": "4", "SLURMFT_PG_TIMEOUT_S": "60"}
# What a node's warm server logs for each rank it forks (launch/warm.py), and a client that could
# not be served (launch/warmclient.py).
FORKED = re.compile(r"slurmft warm server\[\d+\]: rank (\d+) \(attempt (\d+)\) forked warm as pid")
COLD = "starting this rank cold"


def _allocation(run) -> dict:
    return json.loads(RunDir(run).allocation.read_text())


def _wait_running_until_end(job: TrainJob, timeout: float) -> list[JobState]:
    """Poll the job to its end; every state it was seen in from its start, in order (deduplicated)."""
    seen: list[JobState] = []
    deadline = time.monotonic() + timeout
    while True:
        state = job.state()
        if not seen and state.state is JobState.PENDING:  # not started yet
            pass
        elif not seen or seen[-1] is not state.state:
            seen.append(state.state)
        if state.state.finished:
            return seen
        assert time.monotonic() < deadline, f"job {job.job_id} did not end in {timeout:.0f} s " \
            f"(seen {seen})\n{job.context()}"
        time.sleep(0.5)


def _kill_when_ready(cluster, job: TrainJob, run, *, spares: int) -> tuple[str, int]:
    """Once step 12 ran after the checkpoint of step 10 (and the spares' tasks beat), kill the
    active non-batch node the allocation lists second; (its name, the newest commit then)."""
    job.wait_for(lambda j: any(e.get("step") == 10 for e in job.events(["checkpoint_committed"])),
                 150, "checkpoint of step 10")
    job.wait_step(12, timeout=60)
    alloc = _allocation(run)
    for spare in alloc["spares"][:spares]:
        job.wait_for(lambda j, s=spare: RunDir(run).alive(s).exists(), 60, f"spare {spare}'s beat")
    victim = alloc["active"][1]
    committed = max(RunDir(run).committed_steps())
    cluster.kill_node(victim)
    return victim, committed


def _stall_alive(run, node: str, seconds: float) -> None:
    """A shared filesystem's stall of ``node``'s beat file, stood in for by a non-empty directory
    in its place: every write of it fails for ``seconds`` (the node's TCP beats go on)."""
    alive, held = RunDir(run).alive(node), RunDir(run).alive(node).with_name(f".{node}.stall")
    held.mkdir()
    (held / "x").write_text("")
    for _ in range(50):  # the task may put the file back between the unlink and the rename
        alive.unlink(missing_ok=True)
        try:
            held.rename(alive)
            break
        except OSError:
            time.sleep(0.01)
    else:
        raise AssertionError(f"could not stall {alive}")
    time.sleep(seconds)
    shutil.rmtree(alive)


def _kill_warm_worker(cluster, job: TrainJob, node: str) -> int:
    """kill -9 the rank that ``node``'s warm server forked (a crash of the rank process itself:
    a segfault, the OOM killer), found as the child of that node's server (``warm.is_server``; forked from the
    node's torchrun agent), which is this job's and cluster's (its environment, the agent's, says
    so); returns its pid."""
    mine = [f"SLURM_JOB_ID={job.job_id}".encode(), f"SLURM_CLUSTER_NAME={cluster.cluster_name}".encode(),
            f"SLURMD_NODENAME={node}".encode()]
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if warm.is_server(entry.name) and all(v in environ for v in mine):
            children = [int(p) for t in (entry / "task").iterdir()
                        for p in (t / "children").read_text().split()]
            assert len(children) == 1, f"{node}'s warm server has children {children}"
            os.kill(children[0], signal.SIGKILL)
            return children[0]
    raise AssertionError(f"no warm server of job {job.job_id} on {node}")


def _segments(job: TrainJob) -> list:
    return job.events([journal.SEGMENT_START])


@pytest.mark.timeout(480)
def test_spares_replace_two_killed_nodes_the_second_from_a_spare_job_outside_the_allocation(
        slurm_cluster, tmp_path):
    """The launcher's recovery, twice, without leaving RUNNING: the job's own spare takes the
    first dead node's place; then (``SLURMFT_SPARE_REFILL=1``) the launcher asks Slurm for a
    one-node spare job (the cluster's fourth node), starts that node's task in the spare job's
    allocation, and it takes the second dead node's place. Beside it the real watcher, even in
    operator mode with a short hang timeout, never requeues or holds the run (on the code before
    in-allocation mode it did: its operator rule set the dead node DOWN and recovered the job, and
    its hang rule called the restarting world hung 20 s after the last beat before the fault).
    Issue 27's refill merged into issue 28's spare case (one job start): the refill's own test
    (test_a_spare_job_from_outside_the_allocation_replaces_the_second_dead_node, 2026-11-28) is
    this one's second death."""
    run = tmp_path / "run"
    args = [*TINY_ARGS, "--steps", "80", "--ckpt-every", "5", "--step-sleep", "0.2"]
    job = submit(slurm_cluster, run, args, nodes=3, sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, "SLURMFT_SPARE_NODES": "1", "SLURMFT_SPARE_REFILL": "1"})
    job.watcher = WatcherProc(slurm_cluster, [job.job_id], tmp_path / "watch.log", "--operator",
                              "--hang-timeout", "20", run_dir=run)
    try:
        victim, committed = _kill_when_ready(slurm_cluster, job, run, spares=1)
        alloc = _allocation(run)
        batch = alloc["active"][0]
        assert victim != batch
        [spare] = [n for n in alloc["active"] + alloc["spares"] if n not in (batch, victim)]
        [free] = [n for n in slurm_cluster.nodes() if n not in (batch, victim, spare)]
        # Meanwhile the spare's beat file stalls past the bound, and past what the file alone is
        # given (liveness.FILE_ALONE_S, 10 s), while it takes the victim's place: only its TCP
        # beats keep it from being dropped as a silent spare or fenced as a silent active node
        # (issue 28: the third active node's of a 3 + 1 job before).
        _stall_alive(run, spare, 12)

        def outside_spare_beats(_):
            alloc = _allocation(run)
            return any(j["node"] == free for j in alloc.get("spare_jobs", [])) \
                and free in alloc["spares"] and RunDir(run).alive(free).exists()
        job.wait_for(outside_spare_beats, 150, f"a spare job on {free}, its task beating")
        [holder] = [j["job_id"] for j in _allocation(run)["spare_jobs"] if j["node"] == free]
        assert job.client.job(holder).state is JobState.RUNNING
        assert _allocation(run)["active"] == [batch, spare]
        second_committed = max(RunDir(run).committed_steps())
        slurm_cluster.kill_node(spare)
        states = _wait_running_until_end(job, timeout=300)
    finally:
        job.watcher.kill()
    assert states == [JobState.RUNNING, JobState.COMPLETED], job.context()
    assert job.state().restart_count == 0  # never requeued

    alloc = _allocation(run)
    assert alloc["generation"] == 2 and alloc["active"] == [batch, free] and alloc["spares"] == []
    assert [f["node"] for f in alloc["fenced"]] == [victim, spare]
    faults = [e for e in job.events([journal.FAULT_DETECTED]) if e.get("where") == "allocation"]
    assert [e.get("nodes") for e in faults] == [[victim], [spare]], job.context()
    assert all(e.get("cause") in ("node_silent", "node_death") for e in faults)
    if faults[0].get("cause") == "node_silent":  # both channels had beaten: the TCP one too
        assert "TCP " in faults[0].get("evidence")[0] and "no TCP" not in faults[0].get("evidence")[0]
    actions = [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
    assert [(a.get("action"), a.get("nodes"), a.get("spare"), a.get("world_nodes")) for a in actions] == \
        [("replace_node", [victim], spare, 2), ("replace_node", [spare], free, 2)], job.context()

    # Back at the restored step on 2 nodes each time, a dead node unused from its fence on.
    starts = _segments(job)
    assert all(e.get("world_size") == 2 for e in starts)
    for fault, action, restored in zip(faults, actions, (committed, second_committed)):
        after = [e for e in starts if e.time > fault.time]
        assert after and after[0].get("restored_step") >= restored
        dead = action.get("nodes")[0]
        assert not [e for e in job.events() if e.time > action.time and e.get("node") == dead]
        assert not RunDir(run).alive(dead).exists() or RunDir(run).alive(dead).stat().st_mtime <= action.time
    # The ranks on the spare job's node journaled the training job's id, not the spare job's.
    assert {str(e.get("job_id")) for e in job.events(["segment_start", "loss"])} == {job.job_id}
    # The spare job ended with the training (the launcher cancelled it): nothing left queued.
    held = job.client.jobs([holder])
    assert holder not in held or held[holder].state.finished, held
    assert not [j for j in job.client.user_jobs(pwd.getpwuid(os.getuid()).pw_name).values()
                if not j.state.finished]

    # The watcher's only acts: a fenced node set DOWN (operator mode), when it saw Slurm's
    # NOT_RESPONDING at two polls before Slurm's own SlurmdTimeout made it DOWN.
    watcher = [e for e in job.events([journal.FAULT_DETECTED, journal.RECOVERY_ACTION,
                                      journal.PLANNED_END, journal.GAVE_UP])
               if not journal.in_allocation(e)]
    assert all(e.kind == journal.RECOVERY_ACTION and e.get("action") == "set_down"
               and e.get("nodes") in ([victim], [spare]) for e in watcher), (watcher, job.context())
    node = slurm_cluster.nodes()[victim]
    assert node.state == "DOWN", node.describe()
    if [e for e in watcher if e.get("nodes") == [victim]]:  # set DOWN by the watcher: the launcher's evidence
        assert node.reason.startswith(f"slurmft: watch: fenced by job {job.job_id}'s launcher"), node.reason

    # slurmft status: two faults recovered in the allocation, the spare job's node training.
    out = subprocess.run([sys.executable, "-m", "slurmft.cli", "status", str(run), "--json"],
                         env={**os.environ, **slurm_cluster.env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [(f["where"], f["nodes"], f["recovered"]) for f in report["faults"]] == \
        [("allocation", [victim], True), ("allocation", [spare], True)]
    assert all(f["requeued"] is None and f["acted"] is not None for f in report["faults"])
    assert report["restarts"] == 2 and report["allocation"]["spares"] == []
    assert {victim, spare} <= {f["node"] for f in report["allocation"]["fenced"]}
    assert {"job_id": holder, "node": free} in report["allocation"]["spare_jobs"]

    # Every rank of every world was forked by its node's warm server, the spare job's node's
    # too, none started cold.
    log = job.log_text()
    forks = [(int(r), int(a)) for r, a in FORKED.findall(log)]
    assert {(r, 0) for r in range(2)} <= set(forks), log[-4000:]
    # Two ranks forked for each of the three worlds, the last one's too. Counted, not told apart by
    # attempt: torchrun's TORCHELASTIC_RESTART_COUNT grows on a node whose ranks failed, not on
    # one that restarted them for a waiting spare (which of the two a survivor sees first is a
    # race), so the last world's attempt may be 0, 1 or 2 (">= 2" failed once in a -n 3 run).
    assert len(forks) >= 2 * len(starts) >= 6, log[-4000:]
    assert COLD not in log and "no warm workers" not in log

    # Every step's loss, the first time and when redone after a restore, equals an
    # uninterrupted 2-rank run's bit for bit.
    ref = reference_losses(tmp_path / "reference", args, world_size=2)
    seen = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _, _ in seen} == set(ref)
    for step, loss, samples in seen:
        assert (loss, samples) == ref[step], f"step {step}"


# A slow node, injected: on the last active node of the allocation, torchrun's own process (not
# the node's task, which beats at once, nor its ranks) starts only once the other nodes' world
# (MIN 2 of 3 active: their round closes 3 s after two joined) holds its first step (this code:
# the hold's line in the job log) or trains (the code before: a loss in the journal), at most
# LATE_S: its agent joins that world late, at the worst moment. The product runs unchanged.
LATE_S = 120
LATE_SITECUSTOMIZE = f"""
import json, os, time
def _seen(path, text):
    try:
        with open(path, errors="replace") as f:
            return text in f.read()
    except OSError:
        return False
def _late():
    cmd = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    if cmd[1:3] != [b"-m", {agent.MODULE.encode()!r}] or "SLURMFT_LATE_LOG" not in os.environ:
        return
    run = os.environ["SLURMFT_RUN_DIR"]
    if os.environ.get("SLURMD_NODENAME") != json.load(open(os.path.join(run, "allocation.json")))["active"][-1]:
        return
    deadline = time.monotonic() + {LATE_S}
    while time.monotonic() < deadline and not _seen(os.environ["SLURMFT_LATE_LOG"], "holding the first step") \\
            and not _seen(os.path.join(run, "events.jsonl"), '"kind":"loss"'):
        time.sleep(0.5)
_late()
"""


@pytest.mark.timeout(480)
def test_without_a_spare_the_world_shrinks_and_goes_on_at_the_same_global_sample(slurm_cluster, tmp_path):
    """Also the shrink mode's start-up race, made certain: the last active node's agent joins
    after the others formed a 2-node world. That world holds its first step (it trains
    nothing and journals no start), torchrun's TERM that takes the late node in ends it (88),
    and the 3-node world trains: no preemption save, no requeue (on the code before, the 2-node
    world trained and read that TERM as a preemption: exit 85, requeued)."""
    run = tmp_path / "run"
    late = tmp_path / "late"
    late.mkdir()
    (late / "sitecustomize.py").write_text(LATE_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(late), os.environ.get("PYTHONPATH", "")) if p)
    # Cold (the warm workers' opt-out): every rank a fresh torchrun child, before and after.
    job = submit(slurm_cluster, run, ARGS, nodes=3, sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, "SLURMFT_IN_ALLOCATION": "1", "SLURMFT_MIN_NODES": "2",
                      "SLURMFT_WARM_WORKERS": "0", "PYTHONPATH": path,
                      "SLURMFT_LATE_LOG": str(tmp_path / "run-job.out")})
    victim, committed = _kill_when_ready(slurm_cluster, job, run, spares=0)
    killed_at = time.time()

    states = _wait_running_until_end(job, timeout=300)
    assert states == [JobState.RUNNING, JobState.COMPLETED], job.context()
    assert job.state().restart_count == 0 and not job.events(["preemption"]), job.context()

    alloc = _allocation(run)
    assert alloc["generation"] == 1 and alloc["spares"] == [] and len(alloc["active"]) == 2
    assert victim not in alloc["active"] and [f["node"] for f in alloc["fenced"]] == [victim]
    actions = [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
    assert [(a.get("action"), a.get("nodes"), a.get("spare"), a.get("world_nodes")) for a in actions] == \
        [("shrink", [victim], None, 2)]

    starts = _segments(job)
    before = [e for e in starts if e.time < killed_at]
    after = [e for e in starts if e.time > actions[0].time]
    assert before and all(e.get("world_size") == 3 for e in before)  # no partial world trained
    faults = [e for e in job.events([journal.FAULT_DETECTED]) if e.get("where") == "allocation"]
    assert [e.get("nodes") for e in faults] == [[victim]], job.context()  # no restart counted a crash
    log = job.log_text()
    late_node = alloc["active"][-1]  # the survivors keep their order
    assert f"this world runs without active node(s) {late_node}" in log, log[-4000:]
    assert f"torchrun stopped this world (SIGTERM) to re-form it with {late_node}" in log, log[-4000:]
    assert after and all(e.get("world_size") == 2 for e in after)
    assert after[0].get("restored_step") >= committed and after[0].get("global_batch") == 12
    assert not [e for e in job.events() if e.time > actions[0].time and e.get("node") == victim]
    assert not FORKED.search(job.log_text()), job.log_text()[-4000:]  # opted out: no rank forked

    # The 2-node world replays the steps after the checkpoint on the same samples: every step's
    # samples are an uninterrupted run's (the global batch is kept), the losses equal up to the
    # reduction order of a smaller world.
    ref = reference_losses(tmp_path / "reference", ARGS, world_size=2)
    seen = [(e.get("step"), e.get("loss"), e.get("samples"), e.get("world_size")) for e in job.events(["loss"])]
    assert {s for s, _, _, _ in seen} == set(ref)
    for step, loss, samples, world in seen:
        assert samples == ref[step][1], f"step {step}"
        if world == 2:
            assert loss == pytest.approx(ref[step][0], rel=1e-4), f"step {step}"


@pytest.mark.timeout(600)
def test_the_batch_hosts_death_ends_the_job_and_the_requeue_path_loses_nothing(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    # 2 active + 1 spare, and again after the requeue on the 3 nodes left (issue 28: not 3 + 1).
    job = submit(slurm_cluster, run, ARGS, nodes="2-3", sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, "SLURMFT_SPARE_NODES": "1"}, watch=True)
    job.wait_for(lambda j: any(e.get("step") == 10 for e in job.events(["checkpoint_committed"])),
                 150, "checkpoint of step 10")
    job.wait_step(12, timeout=60)
    batch = _allocation(run)["active"][0]
    assert batch == job.state().batch_host
    committed = max(RunDir(run).committed_steps())
    killed_at = time.time()
    slurm_cluster.kill_node(batch)  # the launcher and the rendezvous store die with it

    final = job.wait_for(lambda j: j.state.finished and j.restart_count >= 1, 420,
                         "the requeued run's end")
    assert final.state is JobState.COMPLETED, job.context()
    assert batch not in final.nodes
    starts = _segments(job)
    requeued = [e for e in starts if e.count("restart_count") >= 1]
    assert requeued and requeued[0].time > killed_at
    assert requeued[0].get("restored_step") >= committed  # nothing lost past the checkpoint
    # No in-allocation recovery was attempted: the launcher died with its node. Slurm keeps a
    # --no-kill job RUNNING without its batch script: another node's task requeued it.
    assert not [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
    requeues = [e for e in job.events(["template"]) if e.get("action") == "requeue"
                and e.count("restart_count") == 0]
    assert requeues and f"the batch host {batch} died" in requeues[0].get("reason")
    assert requeues[0].get("exclude") == batch
    ref = reference_losses(tmp_path / "reference", ARGS, world_size=2)
    seen = [(e.get("step"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _ in seen} == set(ref)
    assert all(samples == ref[step][1] for step, samples in seen)


@pytest.mark.timeout(600)
def test_a_spare_takes_over_long_before_slurm_calls_the_dead_node_down(slow_slurmd_cluster, tmp_path):
    cluster, run = slow_slurmd_cluster, tmp_path / "run"
    # 2 active + 1 spare: the spare's take-over is the same for any world (issue 28: not 3 + 1).
    job = submit(cluster, run, ARGS, nodes=3, sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, "SLURMFT_SPARE_NODES": "1"})
    victim, committed = _kill_when_ready(cluster, job, run, spares=1)
    nodes = CliSlurmClient(env=cluster.env)

    # Training back on the new world (its first step past the restore) while Slurm still has
    # the dead node up: the recovery waited for nothing of Slurm's.
    deadline = time.monotonic() + 240
    while True:
        actions = [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
        back = [e for e in job.events(["loss"]) if actions and e.time > actions[0].time
                and e.get("step") > committed]
        if back:
            break
        assert time.monotonic() < deadline, f"no step past {committed} after the fence\n{job.context()}"
        time.sleep(0.3)
    seen_by_slurm = nodes.nodes([victim])[victim]
    assert not seen_by_slurm.down, f"{victim} DOWN already: the recovery cannot be shown independent"
    assert job.state().state is JobState.RUNNING
    assert [(a.get("action"), a.get("nodes")) for a in actions] == [("replace_node", [victim])]
    # The node rebooted, as a real one comes back: the job's end (its cleanup on every node of
    # the allocation) then waits for nothing either, not SlurmdTimeout's 120 s (issue 28).
    cluster.start_node(victim)

    states = _wait_running_until_end(job, timeout=300)
    assert states == [JobState.RUNNING, JobState.COMPLETED], job.context()
    ref = reference_losses(tmp_path / "reference", ARGS, world_size=2)
    seen = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _, _ in seen} == set(ref)
    assert all((loss, samples) == ref[step] for step, loss, samples in seen)


@pytest.mark.timeout(420)
def test_a_crashed_rank_on_a_healthy_node_is_restarted_in_place(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    # 3 active + 1 spare: a healthy node's crash restarts in place and keeps the spare, and this
    # is the suite's one 3-rank world re-formed and compared bit for bit (with 3 ranks a sum's
    # order changes its last bits: docs/limitations.md, DDP's re-wrap; FSDP2 here is identical).
    job = submit(slurm_cluster, run, ARGS, nodes=4, sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, "SLURMFT_SPARE_NODES": "1"})
    job.wait_for(lambda j: any(e.get("step") == 10 for e in job.events(["checkpoint_committed"])),
                 150, "checkpoint of step 10")
    job.wait_step(12, timeout=60)
    node = _allocation(run)["active"][1]
    # kill -9 of the rank process itself (its warm client passes the status on to torchrun): no
    # handler runs, torchrun sees a crashed rank, and the node's warm server saw it end.
    _kill_warm_worker(slurm_cluster, job, node)
    killed_at = time.time()

    states = _wait_running_until_end(job, timeout=300)
    assert states == [JobState.RUNNING, JobState.COMPLETED], job.context()
    alloc = _allocation(run)
    assert alloc["generation"] == 0 and alloc["fenced"] == [] and node in alloc["active"]
    faults = [e for e in job.events([journal.FAULT_DETECTED]) if e.get("where") == "allocation"]
    actions = [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
    assert [(e.get("cause"), e.get("detected_by"), e.get("nodes")) for e in faults] == \
        [("rank_crash", "launcher", [node])]
    assert "killed by SIGKILL (seen by its node's warm server)" in faults[0].get("evidence")[0]
    assert [(a.get("action"), a.get("world_nodes")) for a in actions] == [("restart_in_place", 3)]
    assert len(alloc["spares"]) == 1  # kept: the node is healthy
    starts = _segments(job)
    assert len(starts) == 2 and starts[1].get("world_size") == 3 and starts[1].get("restored_step") >= 10
    # Journaled when seen: the crash's own time is the fault's, and it was detected before the
    # restarted world started (before: only once that start was read).
    [crash] = job.events([journal.RANK_EXIT])
    assert faults[0].when("fault_time") == pytest.approx(crash.time) and crash.time >= killed_at - 1
    assert faults[0].time < starts[1].time, job.context()
    log = job.log_text()  # both worlds forked warm (the restart in place warm again)
    assert {a for _, a in FORKED.findall(log)} >= {"0", "1"} and COLD not in log, log[-4000:]
    ref = reference_losses(tmp_path / "reference", ARGS, world_size=3)
    seen = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _, _ in seen} == set(ref)
    assert all((loss, samples) == ref[step] for step, loss, samples in seen)


@pytest.mark.timeout(420)
def test_a_hang_that_comes_back_after_every_restart_ends_with_do_not_requeue(slurm_cluster, tmp_path):
    args = [*ARGS, "--watchdog-timeout", "6", "--inject-hang-at", "7", "--inject-hang-rank", "1"]
    run = tmp_path / "run"
    # Two nodes: the launcher's rule (restarts in place without a newer checkpoint) is the same for
    # any world, and each node is a torchrun and a rank at each of the three starts.
    job = submit(slurm_cluster, run, args, nodes=2, sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, "SLURMFT_IN_ALLOCATION": "1", "SLURMFT_ALLOC_RESTARTS": "1"})
    final = job.wait_finished(timeout=360)
    assert final.state is JobState.FAILED and final.exit_code == exitcodes.NO_REQUEUE, job.context()
    assert final.restart_count == 0  # never requeued
    faults = [e for e in job.events([journal.FAULT_DETECTED]) if e.get("where") == "allocation"]
    actions = [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
    assert {e.get("cause") for e in faults} == {"hang"} and len(faults) >= 2
    assert [(a.get("action"), a.get("ok")) for a in actions] == [("restart_in_place", True),
                                                                  ("restart_in_place", False)]
    assert _allocation(run)["fenced"] == []
    assert "2 restarts in place in a row without a newer checkpoint" in job.log_text()
    [why] = [e for e in job.events(["template"]) if e.get("action") == "give_up"]
    assert "SLURMFT_ALLOC_RESTARTS=1" in why.get("reason")


@pytest.mark.timeout(600)
def test_a_preempted_in_allocation_job_saves_requeues_and_resumes_bit_for_bit(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    # 2 active + 1 spare, whose task must end with the others' (issue 28: not 3 + 1).
    job = submit(slurm_cluster, run, ARGS, nodes=3, sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, "SLURMFT_SPARE_NODES": "1"}, watch=True)
    job.wait_step(8, timeout=150)
    job.client.cancel(job.job_id, signal="USR2", batch_only=True)
    final = job.wait_for(lambda j: j.state.finished and j.restart_count >= 1, 420,
                         "the requeued run's end")
    assert final.state is JobState.COMPLETED and final.restart_count == 1, job.context()
    saved = [e.get("step") for e in job.events(["preemption"])]
    starts = [(e.count("restart_count"), e.get("restored_step")) for e in _segments(job)]
    # torchrun, which restarts failed ranks in place in this mode, did not start the preempted
    # ranks again: one segment before the requeue, resumed at the emergency checkpoint after.
    assert len(saved) == 1 and starts == [(0, None), (1, saved[0])], job.context()
    ends = [(e.count("restart_count"), e.get("exit_code")) for e in job.events(["segment_end"])]
    assert ends == [(0, exitcodes.REQUEUE), (1, exitcodes.OK)]
    assert not [e for e in job.events([journal.FAULT_DETECTED]) if e.get("where") == "allocation"]
    ref = reference_losses(tmp_path / "reference", ARGS, world_size=2)
    seen = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert sorted(s for s, _, _ in seen) == sorted(ref)  # every step once: nothing lost or redone
    assert all((loss, samples) == ref[step] for step, loss, samples in seen)


@pytest.mark.timeout(420)
def test_a_hang_on_a_healthy_node_is_restarted_in_place(slurm_cluster, tmp_path):
    # Rank 1 freezes whole (SIGSTOP: its own watchdog cannot fire); rank 0's watchdog ends the
    # world, and torchrun's stop of the frozen rank must not wait its fixed 30 s for the KILL.
    args = [*ARGS, "--watchdog-timeout", "6", "--inject-hang-at", "12", "--inject-hang-rank", "1",
            "--inject-hang-attempt", "0", "--inject-hang-how", "stop"]
    run = tmp_path / "run"
    # Two nodes, rank 1's the hang's: a restart in place is the same for any world.
    job = submit(slurm_cluster, run, args, nodes=2, sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, "SLURMFT_IN_ALLOCATION": "1"})
    states = _wait_running_until_end(job, timeout=360)
    assert states == [JobState.RUNNING, JobState.COMPLETED], job.context()
    faults = [e for e in job.events([journal.FAULT_DETECTED]) if e.get("where") == "allocation"]
    actions = [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
    assert [e.get("cause") for e in faults] == ["hang"] and faults[0].get("detected_by") == "launcher"
    assert [(a.get("action"), a.get("cause"), a.get("ok")) for a in actions] == \
        [("restart_in_place", "hang", True)]
    alloc = _allocation(run)
    assert alloc["generation"] == 0 and alloc["fenced"] == [] and len(alloc["active"]) == 2
    starts = _segments(job)
    assert [e.get("world_size") for e in starts] == [2, 2] and starts[1].get("restored_step") == 10
    log = job.log_text()   # the warm client killed the frozen rank: torchrun never had to
    assert "stopped (state T)" in log and "after torchrun's TERM: killed" in log, log[-4000:]
    assert "forcefully exiting via" not in log, log[-4000:]
    assert not [e for e in job.events(["rank_exit"])]   # a stop, not a crash
    ref = reference_losses(tmp_path / "reference", ARGS, world_size=2)
    seen = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _, _ in seen} == set(ref)
    assert all((loss, samples) == ref[step] for step, loss, samples in seen)
