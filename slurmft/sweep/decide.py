"""The sweep's decision as a pure function of (this node, check results, all nodes, config).

Rules, in order:
1. A node that is DOWN or not responding is never touched.
2. Any failed check: drain with ``slurmft: <check>: <detail>``, unless the node is already drained
   (by us: nothing to do; by anyone else: left alone), or the blast-radius guard says no.
3. No failed check (warnings and skips allowed): resume only a node whose reason starts with
   ``slurmft:``; a drain by a human or another tool is never lifted.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from slurmft.health.result import CheckResult, Status, one_line
from slurmft.slurm.client import Node
from slurmft.slurm.validate import MAX_REASON
from slurmft.sweep.config import REASON_PREFIX, SweepConfig


class Action(str, enum.Enum):
    NONE = "none"
    DRAIN = "drain"
    RESUME = "resume"
    BLOCKED = "blocked"  # would drain, but the blast-radius guard refused


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str
    reason: str = ""  # the drain reason, for DRAIN and BLOCKED
    drained_by_slurmft: int = 0
    allowed: int = 0


def is_ours(node: Node) -> bool:
    return node.reason.startswith(REASON_PREFIX)


def drained_by_slurmft(nodes: Mapping[str, Node]) -> list[str]:
    """Nodes out of service with a slurmft reason (drained, or drained and since gone DOWN)."""
    return sorted(n.name for n in nodes.values() if is_ours(n) and (n.drained or n.down))


def drain_allowance(total: int, cfg: SweepConfig) -> int:
    return max(cfg.min_drain_allowed, math.floor(cfg.max_drain_share * total + 1e-9))


def drain_reason(failed: Sequence[CheckResult]) -> str:
    first = failed[0]
    more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
    tail = f"{first.check}: {first.detail}"
    return one_line(f"{REASON_PREFIX} {tail}", MAX_REASON - len(more)) + more


def decide(node: Node, results: Sequence[CheckResult], nodes: Mapping[str, Node],
           cfg: SweepConfig) -> Decision:
    ours = drained_by_slurmft(nodes)
    allowed = drain_allowance(len(nodes), cfg)
    count = dict(drained_by_slurmft=len(ours), allowed=allowed)
    if node.down or not node.responding:
        return Decision(Action.NONE, f"node is {node.state.value}"
                        f"{'' if node.responding else ' and not responding'}: never touched", **count)
    failed = [r for r in results if r.status is Status.FAIL]
    if failed:
        reason = drain_reason(failed)
        if node.drained:
            who = "slurmft" if is_ours(node) else f"someone else ({node.reason or 'no reason'})"
            return Decision(Action.NONE, f"unhealthy, already drained by {who}", reason, **count)
        if len(ours) >= allowed:
            return Decision(Action.BLOCKED,
                            f"blast-radius guard: {len(ours)} of {len(nodes)} nodes already drained by "
                            f"slurmft, at most {allowed} allowed; not draining", reason, **count)
        return Decision(Action.DRAIN, f"{len(failed)} check(s) failed", reason, **count)
    if node.drained and is_ours(node):
        return Decision(Action.RESUME, "all checks pass; lifting slurmft's own drain", **count)
    if node.drained:
        return Decision(Action.NONE, f"healthy, but drained by someone else ({node.reason}): left alone", **count)
    return Decision(Action.NONE, "healthy", **count)


def keep_after_race(me: str, nodes_after: Mapping[str, Node], cfg: SweepConfig) -> bool:
    """After draining ``me``: may the drain stand? Sweeps on many nodes can drain at the same
    moment (a broken shared filesystem fails every node at once); each re-reads the nodes after
    its drain and, if slurmft's drains now exceed the allowance, only the first ``allowed`` by
    name keep theirs, so every racing sweep reaches the same verdict."""
    ours = drained_by_slurmft(nodes_after)
    allowed = drain_allowance(len(nodes_after), cfg)
    return len(ours) <= allowed or me in ours[:allowed]
