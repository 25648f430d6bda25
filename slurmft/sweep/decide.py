"""The sweep's decision as a pure function of (this node, check results, all nodes, config).

Rules, in order:
1. A node that is DOWN or not responding is never touched.
2. Any failed check: drain with ``slurmft: <check>: <detail>``, unless the node is already drained
   (by us: nothing to do; by anyone else: left alone), or the blast-radius guard says no.
3. No failed check (warnings and skips allowed): resume only a node whose reason starts with
   ``slurmft:``, and only when every check behind that drain ran in this sweep and passed; a
   check that was skipped (no NVML, unreadable /dev/kmsg) or not run keeps the drain
   (``Action.KEEP``, saying why). A drain by a human or another tool is never lifted. Nor is
   a slurmft drain the sweep's memory has no record of while that memory is known to have been
   lost (``lost``: an unreadable state file forgot the Xids and checks behind it).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Mapping, Sequence, TypedDict

from slurmft.health.result import CheckResult, Status, one_line
from slurmft.slurm.client import Node
from slurmft.slurm.validate import MAX_REASON
from slurmft.sweep.config import REASON_PREFIX, SweepConfig


class Action(str, enum.Enum):
    NONE = "none"
    DRAIN = "drain"
    RESUME = "resume"
    BLOCKED = "blocked"  # would drain, but the blast-radius guard refused
    KEEP = "keep"  # no check failed, but the check behind slurmft's drain could not run


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str
    reason: str = ""  # the drain reason, for DRAIN and BLOCKED
    drained_by_slurmft: int = 0
    allowed: int = 0


class _Counts(TypedDict):
    """The blast-radius counts every Decision carries (its keyword fields)."""

    drained_by_slurmft: int
    allowed: int


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


# "slurmft: <check>: <detail>[ (+N more)]", as drain_reason() writes it.
_REASON = re.compile(re.escape(REASON_PREFIX) + r" (?P<check>[a-z0-9][a-z0-9_-]*): .*?(?: \(\+(?P<more>\d+) more\))?$")


def checks_behind_drain(reason: str, recorded: Sequence[str] = ()) -> tuple[frozenset[str], bool]:
    """The checks a slurmft drain stands for, and whether that list is complete.

    ``recorded``: the failed checks the sweep saved when it drained with this very reason (the
    state file); without that record the reason names only the first check, and one ending in
    "(+N more)" is incomplete."""
    found = _REASON.match(reason)
    named = {found["check"]} if found else set()
    if recorded:
        return frozenset(named | set(recorded)), bool(found)
    return frozenset(named), found is not None and not found["more"]


def resume_blocker(reason: str, results: Sequence[CheckResult],
                   recorded: Sequence[str] = ()) -> str:
    """Why slurmft's own drain must stay although no check failed ("" when it may be lifted):
    lifting it needs proof, i.e. each check behind it ran in this sweep and did not skip."""
    by_name = {r.check: r for r in results}
    behind, complete = checks_behind_drain(reason, recorded)
    if not behind:
        return f"its reason names no check this sweep knows ({reason!r})"
    if not complete:  # some checks behind it are unknown: every check must have run
        behind = behind | frozenset(by_name)
    missing = sorted(c for c in behind if c not in by_name)
    if missing:
        return f"{', '.join(missing)} did not run in this sweep"
    skipped = [by_name[c] for c in sorted(behind) if by_name[c].status is Status.SKIPPED]
    return "; ".join(f"{r.check} could not run ({r.detail})" for r in skipped)


def decide(node: Node, results: Sequence[CheckResult], nodes: Mapping[str, Node],
           cfg: SweepConfig, recorded: Sequence[str] = (), lost: str = "") -> Decision:
    """``recorded``: the checks this node's sweeper saved as the cause of its last drain;
    ``lost``: why the sweeper's memory of this boot is incomplete ("" when it is whole)."""
    ours = drained_by_slurmft(nodes)
    allowed = drain_allowance(len(nodes), cfg)
    count = _Counts(drained_by_slurmft=len(ours), allowed=allowed)
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
        blocker = lost if lost and not recorded else resume_blocker(node.reason, results, recorded)
        if blocker:
            return Decision(Action.KEEP, f"no check failed, but keeping slurmft's drain: {blocker}",
                            **count)
        return Decision(Action.RESUME, "every check behind slurmft's drain ran and passed; "
                        "lifting it", **count)
    if node.drained:
        return Decision(Action.NONE, f"healthy, but drained by someone else ({node.reason}): left alone", **count)
    return Decision(Action.NONE, "healthy", **count)


def keep_after_race(nodes_after: Mapping[str, Node], cfg: SweepConfig) -> bool:
    """After draining: may the drain stand? Sweeps on many nodes can drain at the same moment
    (a broken shared filesystem fails every node at once). Each re-reads the nodes after its own
    drain landed and keeps it only if slurmft's drains, as seen then, are within the allowance.

    That makes the allowance a hard limit: of the sweeps that keep, take the one that re-read
    last; every other keeper's drain had landed before its own re-read, so that last reader saw
    all of them (and any not yet withdrawn) and found them within the allowance. The price is
    that racing sweeps may all withdraw; the next sweep (cron splay) tries again."""
    return len(drained_by_slurmft(nodes_after)) <= drain_allowance(len(nodes_after), cfg)
