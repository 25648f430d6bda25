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
    passed = OK + [CheckResult.ok("external_nhc", "all good")]
    assert decide(me, passed, cluster(me), CFG).action is Action.RESUME
    assert decide(me, FAIL, cluster(me), CFG).action is Action.NONE


ECC = "slurmft: gpu_ecc: GPU 1 (0000:3b:00.0): 2 volatile double-bit ECC errors"


@pytest.mark.parametrize("reason, results, why", [
    # NVML gone (driver unloaded): every GPU check skips; that proves nothing about the ECC error
    (ECC, OK + [CheckResult.skipped("gpu_ecc", "NVML not available: Driver Not Loaded")],
     "gpu_ecc could not run (NVML not available: Driver Not Loaded)"),
    ("slurmft: gpu_xid: Xid 79 on 0000:3b:00 (GPU has fallen off the bus)",
     OK + [CheckResult.skipped("gpu_xid", "cannot read /dev/kmsg: Permission denied")],
     "gpu_xid could not run (cannot read /dev/kmsg: Permission denied)"),
    (ECC, OK, "gpu_ecc did not run in this sweep"),  # --quick, or [sweep] checks changed
    ("slurmft: drained by hand", OK, "its reason names no check this sweep knows"),
    # "(+1 more)" and no record of which: every check must have run
    (ECC + " (+1 more)", OK + [CheckResult.ok("gpu_ecc", "0 errors"),
                               CheckResult.skipped("dcgm_health", "dcgmi not installed")],
     "dcgm_health could not run (dcgmi not installed)"),
])
def test_own_drain_is_kept_while_the_check_behind_it_cannot_run(reason, results, why):
    me = node("n1", NodeState.IDLE, {"DRAIN"}, reason)
    d = decide(me, results, cluster(me), CFG)
    assert d.action is Action.KEEP and d.why.startswith("no check failed, but keeping slurmft's drain: ")
    assert why in d.why


def test_the_saved_record_names_every_check_behind_a_drain():
    me = node("n1", NodeState.IDLE, {"DRAIN"}, ECC + " (+1 more)")
    results = OK + [CheckResult.ok("gpu_ecc", "0 errors"), CheckResult.ok("node_disk", "ok"),
                    CheckResult.skipped("dcgm_health", "dcgmi not installed")]
    assert decide(me, results, cluster(me), CFG, recorded=("gpu_ecc", "node_disk")).action is Action.RESUME
    assert decide(me, results, cluster(me), CFG).action is Action.KEEP
    d = decide(me, results, cluster(me), CFG, recorded=("gpu_ecc", "gpu_xid"))
    assert d.action is Action.KEEP and "gpu_xid did not run" in d.why


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


def test_a_drain_stands_only_if_slurmft_s_drains_are_within_the_allowance_when_re_read():
    earlier = node("n15", NodeState.IDLE, {"DRAIN"}, "slurmft: node_disk: full")
    racers = [node(n, NodeState.IDLE, {"DRAIN"}, "slurmft: node_mounts: /lustre not mounted")
              for n in ("n01", "n02")]
    twenty = {f"n{i:02d}": node(f"n{i:02d}") for i in range(1, 21)}
    assert drain_allowance(20, CFG) == 2
    # the case: both racers see the earlier drain and each other's: neither keeps
    both = {**twenty, **{n.name: n for n in (earlier, *racers)}}
    assert not keep_after_race(both, CFG)
    assert keep_after_race({**twenty, "n15": earlier, "n01": racers[0]}, CFG)


def _final_drains(order: tuple[str, ...], racers: list[str], established: int, total: int) -> int:
    """Replay one interleaving of racing sweeps (each: its drain lands, later it re-reads and
    at once keeps or withdraws) against the real keep_after_race; the drains left at the end."""
    up = {n: node(n) for n in (f"x{i}" for i in range(total - established - len(racers)))}
    up.update({f"e{i}": node(f"e{i}", NodeState.IDLE, {"DRAIN"}, "slurmft: node_disk: full")
               for i in range(established)})
    view = {**up, **{r: node(r) for r in racers}}
    for step in order:
        who, what = step.split(":")
        if what == "drain":
            view[who] = node(who, NodeState.IDLE, {"DRAIN"}, "slurmft: node_mounts: gone")
        elif not keep_after_race(view, CFG):
            view[who] = node(who)
    return len([n for n in view.values() if n.drained])


def test_the_allowance_holds_in_every_interleaving_of_racing_sweeps():
    import itertools

    for racers, established, total in ((["a", "b", "c"], 1, 20), (["a", "b", "c"], 0, 4),
                                       (["a", "b", "c", "d"], 0, 20)):
        allowed = drain_allowance(total, CFG)
        events = [f"{r}:{e}" for r in racers for e in ("drain", "read")]
        kept_any = False
        for order in itertools.permutations(events):
            if any(order.index(f"{r}:drain") > order.index(f"{r}:read") for r in racers):
                continue
            left = _final_drains(order, racers, established, total)
            assert left <= allowed, (order, left, allowed)
            kept_any |= left > established
        assert kept_any  # some interleavings let a racer keep its drain
