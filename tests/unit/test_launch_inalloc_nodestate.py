"""The in-allocation supervisor fences the nodes Slurm says must not train (``launch/nodestate.py``):
a node the sweeper drained for a failing health check, or an admin drained, or Slurm set DOWN,
while its task still beats. Slurm's answers are real captured ``sinfo --json`` outputs (22.05,
tests/fixtures/slurm/README.md names each one's source), parsed by the real parser; only the
controller call is stood in for (the devcluster test drains a real node:
tests/integration/test_inalloc_nodestate.py). The nodes' sruns are real local processes."""

import json
import time
from pathlib import Path

import pytest

from inalloc_support import start_beating_steps
from launch_envs import recorded
from slurmft import journal
from slurmft.journal import read_events
from slurmft.launch import alloc_settings, identity, inalloc, nodestate, procs, settings
from slurmft.launch.journaling import Voice
from slurmft.launch.rendezvous import Rendezvous
from slurmft.launch.signals import SignalLog
from slurmft.rundir import RunDir
from slurmft.slurm.client import SlurmUnavailable
from slurmft.slurm.parse_nodes import parse_nodes

pytestmark = pytest.mark.timeout(60)

SLURM = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
DRAIN_DOWN = SLURM / "2205" / "sinfo_drain_down.json"        # n3 sweeper-drained, n4 DOWN
PROLOG_DRAIN = SLURM / "2205" / "sinfo_prolog_error_drain.json"  # n2 drained by Slurm: "Prolog error"


def _captured(path: Path):
    return parse_nodes(path.read_text(), "sinfo --json")


class Client:
    """What the supervisor asks the controller, answered with a captured real output."""

    def __init__(self, answer: Path | None) -> None:
        self.answer = answer
        self.asked: list[list[str]] = []
        self.killed: list[tuple[str, str, str]] = []

    def nodes(self, names=None):
        self.asked.append(list(names or []))
        if self.answer is None:
            raise SlurmUnavailable("sinfo: error: Unable to contact slurm controller (connect failure)")
        found = _captured(self.answer)
        return {n: v for n, v in found.items() if names is None or n in names}

    def signal_step(self, job_id, step_id, signal="KILL"):
        self.killed.append((job_id, step_id, signal))


def _supervisor(tmp_path, answer: Path | None, *, batch: str = "n1", **env):
    full = {**recorded("nonarray"), "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4",
            "SLURM_NNODES": "4", "SLURMD_NODENAME": batch, "SLURM_TOPOLOGY_ADDR": batch,
            "SLURMFT_RUN_DIR": str(tmp_path), **env}
    ident = identity.from_environ(full)
    cfg = settings.from_environ(full, ident)
    alloc = alloc_settings.from_environ(full, ident)
    client = Client(answer)
    logged: list[str] = []
    voice = Voice(ident, tmp_path)
    voice.log = logged.append  # type: ignore[method-assign]
    sup = inalloc.Supervisor(ident, cfg, alloc, Rendezvous(batch, 40001, "r"), ["train.py"], full,
                             SignalLog(), voice, client, lambda name: None, lambda: None)
    run = RunDir(tmp_path)
    start_beating_steps(sup, run, ident.nodes)
    sup.liveness.poll()  # every node beats: none is silent
    return sup, client, run, logged


def _events(run, kind):
    return [e for e in read_events(run.events, [kind]) if e.get("where") == "allocation"]


def _commit(sup, run, step: int) -> None:
    """The ranks journal a committed checkpoint of this segment; the supervisor's loop reads it."""
    journal.append_event(run.events, journal.CHECKPOINT_COMMITTED, job_id=sup.ident.slurm_id,
                         restart_count=sup.ident.restart_count, step=step)
    sup.process_faults.poll()


def _stop(sup):
    for step in sup.steps.values():
        procs.stop(step.proc, kill_after_s=1)


def test_slurms_word_on_a_node_from_real_sinfo_output():
    nodes = _captured(DRAIN_DOWN)
    assert nodestate.unfit(nodes["n1"]) is None and nodestate.unfit(nodes["n2"]) is None
    drained, down = nodestate.unfit(nodes["n3"]), nodestate.unfit(nodes["n4"])
    assert drained is not None and drained.cause == "node_unhealthy"
    assert "slurmft: gpu: xid 79 (fallen off the bus)" in drained.evidence and "DRAIN" in drained.evidence
    assert down is not None and down.cause == "node_down" and "Not responding" in down.evidence
    prolog = nodestate.unfit(_captured(PROLOG_DRAIN)["n2"])
    assert prolog is not None and prolog.cause == "node_drained" and "Prolog error" in prolog.evidence


def test_a_drained_active_node_that_still_beats_is_replaced_by_the_spare_after_the_next_checkpoint(tmp_path):
    """Not the sweeper's drain (Slurm's own, for a prolog error; an admin's is the same): a drain
    lets what runs finish, so n2 trains on until a checkpoint newer than the one committed when
    the drain was first seen commits; then it is fenced and the spare takes its place."""
    sup, client, run, logged = _supervisor(tmp_path, PROLOG_DRAIN, SLURMFT_SPARE_NODES="1")
    try:
        _commit(sup, run, 10)
        sup._fence_found()
        assert _events(run, journal.RECOVERY_ACTION) == []  # no answer yet: nothing fenced
        sup.node_states.poll_once()
        assert sorted(client.asked[0]) == ["n1", "n2", "n3", "n4"]
        sup._fence_found()
        sup._fence_found()
        assert _events(run, journal.FAULT_DETECTED) == [] and "n2" in sup.steps  # it trains on
        [said] = [line for line in logged if "an admin's drain" in line]
        assert "n2 trains on until the next checkpoint commits (at most 3600 s)" in said
        _commit(sup, run, 10)  # the same checkpoint again: still waits
        sup._fence_found()
        assert _events(run, journal.FAULT_DETECTED) == []
        _commit(sup, run, 15)
        sup._fence_found()
        alloc = json.loads(run.allocation.read_text())
        assert (alloc["generation"], alloc["active"], alloc["spares"]) == (1, ["n1", "n4", "n3"], [])
        [fault] = _events(run, journal.FAULT_DETECTED)
        assert (fault.get("cause"), fault.get("nodes"), fault.get("detected_by")) == \
            ("node_drained", ["n2"], "launcher")
        assert "Prolog error" in fault.get("evidence")[0]
        assert "checkpoint step 15 committed after it was seen" in fault.get("evidence")[0]
        [action] = _events(run, journal.RECOVERY_ACTION)
        assert (action.get("action"), action.get("nodes"), action.get("spare")) == ("replace_node", ["n2"], "n4")
        # It still beats: its agent is given LEAVE_GRACE_S to leave torchrun's rendezvous
        # (rdzv_leave) before its step is killed; this one's task never ends by itself.
        assert "n2" in sup.steps and client.killed == []
        sup._end_leaving()
        assert "n2" in sup.steps and client.killed == []
        sup._leaving["n2"].until = time.monotonic()
        sup._end_leaving()
        assert "n2" not in sup.steps and not sup._leaving
        deadline = time.monotonic() + 10
        while not client.killed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.killed == [("1", "11", "KILL")]  # its tasks killed through Slurm
        sup._fence_found()  # the same answer again: the fenced node is not fenced twice
        assert len(_events(run, journal.RECOVERY_ACTION)) == 1
    finally:
        _stop(sup)


def test_a_down_spare_is_dropped_before_a_drained_node_is_replaced(tmp_path):
    """The sweeper drained n3 (active), Slurm has n4 (the spare) DOWN: the spare is fenced first,
    so it never replaces n3; the world shrinks instead (SLURMFT_MIN_NODES=2)."""
    sup, client, run, _ = _supervisor(tmp_path, DRAIN_DOWN, SLURMFT_SPARE_NODES="1", SLURMFT_MIN_NODES="2")
    try:
        sup.node_states.poll_once()
        sup._fence_found()
        actions = _events(run, journal.RECOVERY_ACTION)
        assert [(a.get("action"), a.get("nodes"), a.get("cause")) for a in actions] == \
            [("fence", ["n4"], "node_down"), ("shrink", ["n3"], "node_unhealthy")]
        alloc = json.loads(run.allocation.read_text())
        assert (alloc["active"], alloc["spares"]) == (["n1", "n2"], [])
    finally:
        _stop(sup)


def test_without_a_spare_or_room_to_shrink_a_drained_node_goes_the_requeue_path(tmp_path):
    sup, client, run, _ = _supervisor(tmp_path, PROLOG_DRAIN, SLURMFT_IN_ALLOCATION="1")
    try:
        sup.node_states.poll_once()
        sup._fence_found()  # the drain was seen: it waits for the next checkpoint
        _commit(sup, run, 5)
        with pytest.raises(inalloc.GoRequeue) as requeue:
            sup._fence_found()
        assert list(requeue.value.exclude) == ["n2"] and "Prolog error" in requeue.value.exclude["n2"]
    finally:
        _stop(sup)


def test_the_batch_hosts_drain_is_left_to_the_requeue_path_and_warned_about_once(tmp_path):
    """Batch host n3 (sweeper-drained) cannot be replaced: warned about, never fenced; the DOWN
    spare n4 still is."""
    sup, client, run, logged = _supervisor(tmp_path, DRAIN_DOWN, batch="n3", SLURMFT_SPARE_NODES="1")
    try:
        assert sup.alloc.active[0] == "n3" and sup.alloc.spares == ("n4",)
        sup.node_states.poll_once()
        sup._fence_found()
        sup._fence_found()
        actions = _events(run, journal.RECOVERY_ACTION)
        assert [(a.get("action"), a.get("nodes")) for a in actions] == [("fence", ["n4"])]
        warned = [line for line in logged if "batch host cannot be replaced" in line]
        assert len(warned) == 1 and "slurmft: gpu: xid 79" in warned[0]
        assert "n3" in sup.steps
    finally:
        _stop(sup)


def test_no_answer_from_slurm_fences_nothing_and_says_so_once(tmp_path):
    sup, client, run, logged = _supervisor(tmp_path, None, SLURMFT_SPARE_NODES="1")
    try:
        for _ in range(3):
            sup.node_states.poll_once()
            sup._fence_found()
        assert _events(run, journal.RECOVERY_ACTION) == [] and len(client.asked) == 3
        assert len([line for line in logged if "could not read the nodes' state" in line]) == 1
        client.answer = PROLOG_DRAIN  # it answers again: the drain is acted on
        sup.node_states.poll_once()
        sup._fence_found()
        _commit(sup, run, 5)
        sup._fence_found()
        assert [a.get("nodes") for a in _events(run, journal.RECOVERY_ACTION)] == [["n2"]]
    finally:
        _stop(sup)


def test_the_poll_of_slurm_runs_at_the_users_interval(tmp_path):
    sup, _, _, _ = _supervisor(tmp_path, None, SLURMFT_SPARE_NODES="1", SLURMFT_NODE_POLL_S="3")
    (tmp_path / "d").mkdir()
    default, _, _, _ = _supervisor(tmp_path / "d", None, SLURMFT_SPARE_NODES="1")
    try:
        assert (sup.node_states.poll_s, default.node_states.poll_s) == (3.0, nodestate.POLL_S)
    finally:
        _stop(sup)
        _stop(default)


def test_a_drain_with_no_checkpoint_within_the_bound_is_fenced_anyway(tmp_path):
    """No commit since the drain was seen: fenced once the bound (the watcher's rule: twice the
    run's median checkpoint interval, at least 120 s; 3600 s with no interval known) passed."""
    sup, client, run, _ = _supervisor(tmp_path, PROLOG_DRAIN, SLURMFT_SPARE_NODES="1")
    try:
        sup.node_states.poll_once()
        sup._fence_found()
        assert _events(run, journal.FAULT_DETECTED) == [] and sup.node_states.drain_bound() == 3600
        since, before = sup.node_states._drains["n2"]
        sup.node_states._drains["n2"] = (since - 3601, before)  # an hour went by
        sup._fence_found()
        [fault] = _events(run, journal.FAULT_DETECTED)
        assert fault.get("nodes") == ["n2"] and "no checkpoint committed in the 3601 s" in fault.get("evidence")[0]
    finally:
        _stop(sup)


def test_the_bound_follows_the_runs_checkpoint_interval(tmp_path):
    states = nodestate.NodeStates(None, lambda: [], lambda line: None)
    states._commits = [(0.0, 5), (100.0, 10), (200.0, 15)]
    assert states.drain_bound() == 200.0   # 2 x the median interval of 100 s
    states._commits = [(0.0, 5), (10.0, 10), (20.0, 15)]
    assert states.drain_bound() == 120.0   # at least 120 s


def test_a_drained_spare_is_fenced_at_once(tmp_path):
    """Only a drain of a training node waits: a spare trains nothing (n2 is one here). The
    sweeper's drain and DOWN are fenced on sight (test_a_down_spare_is_dropped_before...)."""
    sup, client, run, _ = _supervisor(tmp_path, PROLOG_DRAIN, SLURMFT_SPARE_NODES="3")
    try:
        assert sup.alloc.spares == ("n2", "n3", "n4")
        sup.node_states.poll_once()
        sup._fence_found()
        assert [(a.get("action"), a.get("nodes")) for a in _events(run, journal.RECOVERY_ACTION)] == \
            [("fence", ["n2"])]
    finally:
        _stop(sup)
