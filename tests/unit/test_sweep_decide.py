"""The sweep decision as a pure function: who is drained, resumed or left alone; the guard."""

from __future__ import annotations

import pytest

from slurmft.health.result import CheckResult
from slurmft.slurm.client import Node, NodeState
from slurmft.slurm.validate import MAX_REASON
from slurmft.sweep.config import SweepConfig
from slurmft.sweep.decide import Action, decide, drain_allowance, drain_reason, keep_after_race

OK = [CheckResult.ok("node_memory", "20 GiB available"), CheckResult.warn("gpu_throttle", "GPU 0 hw_slowdown")]
FAIL = OK + [CheckResult.fail("external_nhc", "ERROR: nv_gpu_count 7 != 8")]
CFG = SweepConfig()


def node(name, state=NodeState.IDLE, flags=(), reason=""):
    return Node(name, state, frozenset(flags), reason)


def cluster(*nodes, total=4):
    names = {n.name: n for n in nodes}
    for i in range(1, total + 1):
        names.setdefault(f"n{i}", node(f"n{i}"))
    return names


def test_failing_node_is_drained_with_prefixed_reason():
    d = decide(node("n1"), FAIL, cluster(), CFG)
    assert d.action is Action.DRAIN and d.reason == "slurmft: external_nhc: ERROR: nv_gpu_count 7 != 8"


def test_warnings_never_drain():
    assert decide(node("n1"), OK, cluster(), CFG).action is Action.NONE


def test_several_failures_name_the_first_and_count_the_rest():
    two = FAIL + [CheckResult.fail("gpu_ecc", "GPU 1: 2 volatile double-bit ECC errors")]
    assert drain_reason([r for r in two if r.status.value == "fail"]).endswith("7 != 8 (+1 more)")


def test_reason_is_cut_cleanly_to_what_slurm_takes():
    long = [CheckResult.fail("gpu_xid", "; ".join(f"Xid 79 on 0000:{i:02x}:00 (GPU has fallen off the bus)" for i in range(20))),
            CheckResult.fail("gpu_count", "expected 8 GPUs, NVML sees 0")]
    reason = drain_reason(long)
    assert len(reason) <= MAX_REASON and reason.endswith("... (+1 more)") and reason.startswith("slurmft: gpu_xid: ")
    assert ";..." not in reason and "\n" not in reason


@pytest.mark.parametrize("me", [
    node("n1", NodeState.DOWN),
    node("n1", NodeState.IDLE, {"NOT_RESPONDING"}),
    node("n1", NodeState.DOWN, {"DRAIN"}, "slurmft: gpu_xid: Xid 79"),
])
def test_down_or_unresponsive_nodes_are_never_touched(me):
    assert decide(me, FAIL, cluster(me), CFG).action is Action.NONE
    assert decide(me, OK, cluster(me), CFG).action is Action.NONE


def test_node_drained_by_someone_else_stays_drained():
    me = node("n1", NodeState.IDLE, {"DRAIN"}, "bad DIMM, ticket 4711")
    assert decide(me, OK, cluster(me), CFG).action is Action.NONE
    d = decide(me, FAIL, cluster(me), CFG)
    assert d.action is Action.NONE and "someone else (bad DIMM, ticket 4711)" in d.why


def test_own_drain_is_resumed_when_healthy_and_kept_when_not():
    me = node("n1", NodeState.IDLE, {"DRAIN"}, "slurmft: external_nhc: broken")
    assert decide(me, OK, cluster(me), CFG).action is Action.RESUME
    assert decide(me, FAIL, cluster(me), CFG).action is Action.NONE


def test_blast_radius_guard_rounds_down_with_a_floor_of_one():
    assert [drain_allowance(n, CFG) for n in (1, 4, 9, 10, 19, 20, 100)] == [1, 1, 1, 1, 1, 2, 10]
    assert drain_allowance(4, SweepConfig(min_drain_allowed=0)) == 0
    other = node("n2", NodeState.IDLE, {"DRAIN"}, "slurmft: node_disk: full")
    d = decide(node("n1"), FAIL, cluster(other), CFG)
    assert d.action is Action.BLOCKED and d.drained_by_slurmft == 1 and d.allowed == 1
    assert "1 of 4 nodes already drained by slurmft, at most 1 allowed" in d.why
    # human drains do not count against slurmft's allowance
    human = node("n2", NodeState.IDLE, {"DRAIN"}, "maintenance")
    assert decide(node("n1"), FAIL, cluster(human), CFG).action is Action.DRAIN


def test_racing_sweeps_agree_on_who_keeps_the_drain():
    drained = {n: node(n, NodeState.IDLE, {"DRAIN"}, "slurmft: node_mounts: /lustre not mounted")
               for n in ("n1", "n3")}
    after = cluster(*drained.values())
    assert keep_after_race("n1", after, CFG) and not keep_after_race("n3", after, CFG)
    assert keep_after_race("n3", cluster(drained["n3"]), CFG)
