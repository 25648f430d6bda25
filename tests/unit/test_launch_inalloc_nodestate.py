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


def test_a_drained_active_node_that_still_beats_is_replaced_by_the_spare(tmp_path):
    sup, client, run, _ = _supervisor(tmp_path, PROLOG_DRAIN, SLURMFT_SPARE_NODES="1")
    try:
        sup._fence_found()
        assert _events(run, journal.RECOVERY_ACTION) == []  # no answer yet: nothing fenced
        sup.node_states.poll_once()
        assert sorted(client.asked[0]) == ["n1", "n2", "n3", "n4"]
        sup._fence_found()
        alloc = json.loads(run.allocation.read_text())
        assert (alloc["generation"], alloc["active"], alloc["spares"]) == (1, ["n1", "n4", "n3"], [])
        [fault] = _events(run, journal.FAULT_DETECTED)
        assert (fault.get("cause"), fault.get("nodes"), fault.get("detected_by")) == \
            ("node_drained", ["n2"], "launcher")
        assert "Prolog error" in fault.get("evidence")[0]
        [action] = _events(run, journal.RECOVERY_ACTION)
        assert (action.get("action"), action.get("nodes"), action.get("spare")) == ("replace_node", ["n2"], "n4")
        assert "n2" not in sup.steps
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
