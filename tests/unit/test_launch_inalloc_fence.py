"""The in-allocation supervisor's fence, on real local processes standing in for the nodes'
sruns (the devcluster test kills a real node: tests/integration/test_inalloc.py): the order
(allocation.json first, then the journal, then the kill), replace / shrink / below the minimum,
and a spare's death that moves no generation."""

import json
import sys
import time

import pytest

from inalloc_support import start_beating_steps
from launch_envs import recorded
from slurmft import exitcodes, journal
from slurmft.journal import read_events
from slurmft.launch import alloc_settings, identity, inalloc, nodesteps, procs, settings
from slurmft.launch.journaling import Voice
from slurmft.launch.rendezvous import Rendezvous
from slurmft.launch.signals import SignalLog
from slurmft.rundir import RunDir
from slurmft.train import rdzv_leave, rdzv_poll

pytestmark = pytest.mark.timeout(60)


class Client:
    def __init__(self) -> None:
        self.killed: list[tuple[str, str, str]] = []

    def signal_step(self, job_id: str, step_id: str, signal: str = "KILL") -> None:
        self.killed.append((job_id, step_id, signal))


def _supervisor(tmp_path, **env):
    full = {**recorded("nonarray"), "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4",
            "SLURM_NNODES": "4", "SLURMFT_RUN_DIR": str(tmp_path), **env}
    ident = identity.from_environ(full)
    cfg = settings.from_environ(full, ident)
    alloc = alloc_settings.from_environ(full, ident)
    client = Client()
    sup = inalloc.Supervisor(ident, cfg, alloc, Rendezvous("n1", 40001, "r"), ["train.py"], full,
                             SignalLog(), Voice(ident, tmp_path), client, lambda name: None,
                             lambda: None)
    run = RunDir(tmp_path)
    start_beating_steps(sup, run, ident.nodes)
    sup.liveness.poll()
    return sup, client, run


def _events(run, kind):
    return [e for e in read_events(run.events, [kind]) if e.get("where") == "allocation"]


def _stop(sup):
    for step in sup.steps.values():
        procs.stop(step.proc, kill_after_s=1)


def _wait_killed(client, n):
    deadline = time.monotonic() + 10
    while len(client.killed) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_silent_active_node_is_replaced_by_the_spare(tmp_path):
    sup, client, run = _supervisor(tmp_path, SLURMFT_SPARE_NODES="1")
    victim = sup.steps["n2"].proc
    try:
        sup.fence(inalloc.Fault("n2", "node_silent", ["no beat for 10.2 s"]))
        alloc = json.loads(run.allocation.read_text())
        assert (alloc["generation"], alloc["active"], alloc["spares"]) == (1, ["n1", "n4", "n3"], [])
        assert [(f["node"], f["cause"], f["evidence"]) for f in alloc["fenced"]] == \
            [("n2", "node_silent", ["no beat for 10.2 s"])]
        [fault] = _events(run, journal.FAULT_DETECTED)
        assert (fault.get("cause"), fault.get("nodes"), fault.get("detected_by")) == \
            ("node_silent", ["n2"], "launcher")
        assert fault.get("fault_time") <= fault.time and fault.get("evidence") == ["no beat for 10.2 s"]
        [action] = _events(run, journal.RECOVERY_ACTION)
        assert (action.get("action"), action.get("nodes"), action.get("spare"),
                action.get("world_nodes"), action.get("generation")) == ("replace_node", ["n2"], "n4", 3, 1)
        assert victim.wait(5) is not None and "n2" not in sup.steps  # our srun is gone at once
        _wait_killed(client, 1)
        assert client.killed == [("1", "11", "KILL")]  # and its tasks through Slurm
    finally:
        _stop(sup)


def test_without_a_spare_the_world_shrinks_down_to_the_minimum_then_requeues(tmp_path):
    sup, client, run = _supervisor(tmp_path, SLURMFT_IN_ALLOCATION="1", SLURMFT_MIN_NODES="3")
    try:
        sup.fence(inalloc.Fault("n3", "node_death", ["its step ended"]))
        alloc = json.loads(run.allocation.read_text())
        assert (alloc["generation"], alloc["active"]) == (1, ["n1", "n2", "n4"])
        [action] = _events(run, journal.RECOVERY_ACTION)
        assert (action.get("action"), action.get("spare"), action.get("world_nodes")) == ("shrink", None, 3)
        with pytest.raises(inalloc.GoRequeue) as below:
            sup.fence(inalloc.Fault("n2", "node_silent", ["no beat"]))
        assert below.value.exclude == {"n2": "no beat"}
        # The requeue avoids every node this allocation lost, not only the last one.
        assert sup.exclusions(below.value.exclude) == {"n3": "its step ended", "n2": "no beat"}
        assert sorted(sup.lost(list(below.value.exclude))) == ["n2", "n3"]
        assert "n1" not in sup.exclusions({"n1": "its step ended"})   # the batch host: never
        assert "below SLURMFT_MIN_NODES=3" in below.value.reason
        # Nothing more is published: the requeue path takes over.
        assert json.loads(run.allocation.read_text())["generation"] == 1
        assert len(_events(run, journal.FAULT_DETECTED)) == 2
        assert len(_events(run, journal.RECOVERY_ACTION)) == 1
    finally:
        _stop(sup)


def test_a_dead_spare_is_fenced_without_moving_the_generation(tmp_path):
    sup, client, run = _supervisor(tmp_path, SLURMFT_SPARE_NODES="1")
    try:
        sup.fence(inalloc.Fault("n4", "node_silent", ["no beat"]))
        alloc = json.loads(run.allocation.read_text())
        assert (alloc["generation"], alloc["active"], alloc["spares"]) == (0, ["n1", "n2", "n3"], [])
        [action] = _events(run, journal.RECOVERY_ACTION)
        assert (action.get("action"), action.get("world_nodes")) == ("fence", 3)
        assert sup.exclusions({}) == {"n4": "no beat"}   # a dead spare too, in a later requeue
    finally:
        _stop(sup)


def test_silence_past_the_bound_is_a_fault_but_not_on_the_batch_host(tmp_path):
    sup, client, run = _supervisor(tmp_path, SLURMFT_SPARE_NODES="1", SLURMFT_NODE_SILENT_S="2")
    try:
        # The file is the only channel here: alone, it needs FILE_ALONE_S (10 s), not 2 s.
        sup.liveness.clock = lambda: time.monotonic() + 3
        assert sup._silent() == []
        sup.liveness.clock = lambda: time.monotonic() + 11
        faults = sup._silent()
        assert [(f.node, f.cause) for f in faults] == [("n2", "node_silent"), ("n3", "node_silent"),
                                                       ("n4", "node_silent")]
        assert "SLURMFT_NODE_SILENT_S=2" in faults[0].evidence[0]
    finally:
        _stop(sup)


def test_each_nodes_agent_is_told_its_node_and_the_rendezvous_poll(tmp_path, monkeypatch):
    """What the agents' rendezvous hooks need (rdzv_leave, rdzv_poll), on every node's step."""
    sup, client, run = _supervisor(tmp_path, SLURMFT_SPARE_NODES="1")
    real = dict(sup.steps)
    extras: dict = {}
    try:
        monkeypatch.setattr(inalloc.nodesteps, "start",
                            lambda node, argv, env, run_dir, extra: extras.setdefault(node, extra))
        for node in ("n1", "n2", "n4"):   # the batch host, another active node, the spare
            sup._start(node)
        assert {n: e[rdzv_leave.LEAVE_ENV] for n, e in extras.items()} == {"n1": "n1", "n2": "n2", "n4": "n4"}
        assert {e[rdzv_poll.ENV] for e in extras.values()} == {"0.1"}
        assert rdzv_poll.parse(extras["n1"][rdzv_poll.ENV]) == rdzv_poll.POLL_S
    finally:
        sup.steps = real
        _stop(sup)


def _ends_with(sup, node: str, rc: int) -> None:
    """Swap ``node``'s stand-in step for one that exits ``rc`` at once."""
    procs.stop(sup.steps[node].proc, kill_after_s=1)
    proc = procs.start([sys.executable, "-c", f"raise SystemExit({rc})"])
    sup.steps[node] = nodesteps.NodeStep(node, proc, time.monotonic())


@pytest.mark.parametrize("rc, killed", [(exitcodes.FENCED, []), (1, [("1", "11", "KILL")])],
                         ids=["its_agent_left", "its_srun_ended_otherwise"])
def test_a_drained_node_that_beats_is_killed_only_if_its_agent_did_not_leave(tmp_path, rc, killed):
    sup, client, run = _supervisor(tmp_path, SLURMFT_SPARE_NODES="1")
    try:
        sup.fence(inalloc.Fault("n2", "node_unhealthy", ["drained"]))
        assert "n2" in sup.steps and "n2" in sup._leaving and client.killed == []  # it may leave
        _ends_with(sup, "n2", rc)
        deadline = time.monotonic() + 10
        while "n2" in sup._leaving and time.monotonic() < deadline:
            sup._reap()
            sup._end_leaving()
            time.sleep(0.05)
        assert "n2" not in sup._leaving and "n2" not in sup.steps
        _wait_killed(client, len(killed))
        time.sleep(0.2)
        assert client.killed == killed   # 89: its agent left and its tasks ended with it
    finally:
        _stop(sup)


def test_a_drained_node_that_no_longer_beats_or_a_leaving_one_at_the_end_is_killed_at_once(
        tmp_path, monkeypatch):
    sup, client, run = _supervisor(tmp_path, SLURMFT_SPARE_NODES="2")
    try:
        sup.fence(inalloc.Fault("n2", "node_unhealthy", ["drained"]))   # n3 replaces it, leaving
        assert "n2" in sup._leaving
        monkeypatch.setattr(sup.liveness, "silent", lambda node, bound: node == "n3")
        sup.fence(inalloc.Fault("n3", "node_drained", ["drained"]))      # silent: cannot leave
        assert "n3" not in sup.steps and "n3" not in sup._leaving
        sup.stop_all()                   # the job's end: no leaving node outlives it
        assert not sup._leaving and not sup.steps
        _wait_killed(client, 2)
        assert sorted(client.killed) == [("1", "11", "KILL"), ("1", "12", "KILL")]
    finally:
        _stop(sup)
