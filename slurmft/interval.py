"""The optimal checkpoint interval: Young's first-order and Daly's higher-order estimates, from a
checkpoint cost and a mean time between failures, given or measured from a run's journal.

With C the time one checkpoint stalls training and M the mean time between failures of the
whole job (M = per-node MTBF / nodes when node failures are independent):

- Young (1974): T = sqrt(2 C M).
- Daly (2006): T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C while C < 2M, else
  T = M (checkpointing that costly cannot pay for itself; save once per expected failure).

T is the compute time between two checkpoints. Measured from a run dir: C is the mean
``blocking_s`` of its ``checkpoint_committed`` events (the stall the training loop saw, not the
background write); M is its wall time divided by its failures (the faults ``slurmft status``
finds, less preemptions and time limits, which save before they stop and so lose no work);
the step time is the median step duration of its newest segment that has one.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from slurmft import journal, numbers
from slurmft.journal import Event
from slurmft.status.report import Report

# Causes that stop a run WITH an emergency checkpoint: no work lost, not failures here.
NOT_FAILURES = frozenset({"preempted", "timeout"})


class IntervalError(ValueError):
    """An input is missing or not usable; the message names it."""


# The largest MTBF taken (~31,700 years: a per-node figure from a datasheet can be centuries);
# a checkpoint cost or a step time is at most numbers.MAX_SECONDS (~11.6 days).
MAX_MTBF_S = 1e12
MAX_NODES = 1_000_000


def positive(name: str, value: float | int | None, unit: str = "seconds",
             most: float = numbers.MAX_SECONDS) -> float | None:
    """``value`` as a float, or IntervalError naming ``name`` when it is not a positive number
    of at most ``most``."""
    if value is None:
        return None
    number = numbers.finite(value)
    if number is None or number <= 0:
        raise IntervalError(f"{name} must be a positive number of {unit}, got {numbers.shown(value)}")
    if number > most:
        raise IntervalError(f"{name} must be at most {most:g} {unit}, got {numbers.shown(value)}")
    return number


def young(cost_s: float, mtbf_s: float) -> float:
    """Young's interval sqrt(2 C M) (two roots: the product of two tiny durations underflows)."""
    return math.sqrt(2.0 * cost_s) * math.sqrt(mtbf_s)


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval (M itself once C >= 2M)."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return young(cost_s, mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


@dataclass(frozen=True)
class Measured:
    """What a run's journal tells about checkpoint cost, failures and step time."""

    cost_s: float | None
    saves: int
    failures: int
    wall_s: float
    num_nodes: int | None
    step_s: float | None

    @property
    def mtbf_s(self) -> float | None:
        return self.wall_s / self.failures if self.failures and self.wall_s > 0 else None


def measure(events: Sequence[Event], report: Report) -> Measured:
    blocking = [b for b in (e.seconds("blocking_s") for e in events
                            if e.kind == journal.CHECKPOINT_COMMITTED) if b is not None]
    failures = sum(1 for f in report.faults if f.cause not in NOT_FAILURES)
    step_s = next((s.median_step_s for s in reversed(report.segments) if s.median_step_s), None)
    nodes = next((s.num_nodes for s in reversed(report.segments) if s.num_nodes), None)
    return Measured(cost_s=statistics.fmean(blocking) if blocking else None, saves=len(blocking),
                    failures=failures, wall_s=report.wall_s, num_nodes=nodes, step_s=step_s)


@dataclass(frozen=True)
class Interval:
    cost_s: float
    mtbf_s: float
    young_s: float
    daly_s: float
    step_s: float | None
    cost_from: str
    mtbf_from: str

    def steps(self, seconds: float) -> int | None:
        """``seconds`` of compute in whole steps (at least 1), when a step time is known."""
        steps = numbers.finite(seconds / self.step_s, 0, numbers.MAX_INT64) if self.step_s else None
        return None if steps is None else max(1, round(steps))


def compute(*, cost_s: float | None, mtbf_s: float | None, nodes: int | None,
            node_mtbf_s: float | None, measured: Measured | None = None,
            step_s: float | None = None) -> Interval:
    """The interval from what was given, filling the gaps from ``measured`` (a run dir)."""
    cost_s = positive("--cost", cost_s)
    mtbf_s = positive("--mtbf", mtbf_s, most=MAX_MTBF_S)
    node_mtbf_s = positive("--node-mtbf", node_mtbf_s, most=MAX_MTBF_S)
    if nodes is not None and numbers.whole(nodes, 1, None) is None:
        raise IntervalError(f"--nodes must be a whole number >= 1, got {numbers.shown(nodes)}")
    if nodes is not None and nodes > MAX_NODES:
        raise IntervalError(f"--nodes must be at most {MAX_NODES}, got {numbers.shown(nodes)}")
    if mtbf_s is not None and (nodes is not None or node_mtbf_s is not None):
        raise IntervalError("give either --mtbf, or --nodes with --node-mtbf, not both")
    if nodes is not None and node_mtbf_s is None:
        raise IntervalError("--nodes needs --node-mtbf (the mean time between failures of one node)")
    cost_from = "--cost"
    if cost_s is None:
        if measured is None:
            raise IntervalError("no checkpoint cost: give --cost SECONDS or --run-dir DIR")
        if measured.cost_s is None or measured.cost_s <= 0:
            raise IntervalError("the run dir's journal has no checkpoint_committed event with a "
                                "blocking time: give --cost SECONDS")
        cost_s = measured.cost_s
        cost_from = f"mean blocking time of {measured.saves} saves in the run dir"
    if mtbf_s is not None:
        mtbf_from = "--mtbf"
    elif node_mtbf_s is not None:
        if nodes is None:
            nodes = measured.num_nodes if measured else None
            if nodes is None:
                raise IntervalError("--node-mtbf needs --nodes (or a run dir whose journal names "
                                    "its node count)")
            mtbf_from = f"{nodes} nodes of the run x per-node MTBF {node_mtbf_s:g} s"
        else:
            mtbf_from = f"{nodes} nodes x per-node MTBF {node_mtbf_s:g} s"
        mtbf_s = node_mtbf_s / nodes
    elif measured is not None:
        if measured.mtbf_s is None:
            raise IntervalError(f"the run dir's journal shows no failure in {measured.wall_s:.0f} s "
                                "of wall time, so no MTBF can be measured: give --mtbf SECONDS or "
                                "--nodes N --node-mtbf SECONDS")
        mtbf_s = measured.mtbf_s
        mtbf_from = f"{measured.failures} failures in {measured.wall_s:.0f} s of the run"
    else:
        raise IntervalError("no MTBF: give --mtbf SECONDS, --nodes N --node-mtbf SECONDS, or --run-dir DIR")
    step = positive("--step-time", step_s) if step_s is not None else (measured.step_s if measured else None)
    return Interval(cost_s=cost_s, mtbf_s=mtbf_s, young_s=young(cost_s, mtbf_s),
                    daly_s=daly(cost_s, mtbf_s), step_s=step, cost_from=cost_from,
                    mtbf_from=mtbf_from)
