"""The give-up rules: when a run must be held rather than restarted again.

Planned ends (``detect.PLANNED``: a time limit, a preemption, a pre-flight requeue) are restarts,
never faults: they count toward no rule, so a run chunked 100 times by its time limit finishes.
Every rule judges progress. A fault restart after which a checkpoint newer than at the fault
restart before it was committed (whatever the planned ends between) made progress, and no rule
holds a run for it: a months-long run on hundreds of nodes sees many node faults and goes on as
long as it moves. The others, stalled restarts, count toward ``max_restarts`` (in total) and their
cause's ``max_restarts_per_cause``; ``crash_loop_restarts`` of them in a row with the same newest
checkpoint is a crash loop. Pure functions of the run's state and the config.
"""

from __future__ import annotations

from slurmft.watch import detect
from slurmft.watch.config import WatchConfig
from slurmft.watch.state import RunState


def fault_restarts(state: RunState) -> int:
    """Restarts for faults (``restarts_by_cause`` less the planned causes: a state written before
    planned ends were told apart reads the same)."""
    return sum(n for cause, n in state.restarts_by_cause.items() if not detect.planned(cause))


def limit_reached(state: RunState, config: WatchConfig, cause: str, newest: int | None) -> str | None:
    """Why the run must be given up rather than restarted for ``cause`` (``newest``: the newest
    committed checkpoint step now), or None."""
    if detect.planned(cause) or progressed(state, newest):
        return None
    stalled = sum(state.stalled_by_cause.values())
    if stalled >= config.max_restarts:
        return (f"{stalled} fault restarts without a newer checkpoint, the most allowed "
                "(max_restarts)")
    if state.stalled_by_cause.get(cause, 0) >= config.max_restarts_per_cause:
        return (f"{state.stalled_by_cause[cause]} restarts for {cause} without a newer checkpoint "
                "(max_restarts_per_cause)")
    if cause in detect.FAULTS:
        recent = state.ckpt_at_recovery[-config.crash_loop_restarts:]
        if len(recent) >= config.crash_loop_restarts and all(s == newest for s in recent):
            return (f"crash loop: no newer checkpoint than step {newest} across "
                    f"{config.crash_loop_restarts} restarts")
    return None


def progressed(state: RunState, newest: int | None) -> bool:
    """A checkpoint newer than at the last fault restart (the first one: any checkpoint) was
    committed: the restart for a fault now follows progress."""
    last = state.ckpt_at_recovery[-1] if state.ckpt_at_recovery else None
    return newest is not None and (last is None or newest > last)


def record_fault_restart(state: RunState, cause: str, newest: int | None) -> None:
    """Remember a restart for the fault ``cause`` with ``newest`` the newest committed step now."""
    if not progressed(state, newest):
        state.stalled_by_cause[cause] = state.stalled_by_cause.get(cause, 0) + 1
    state.ckpt_at_recovery.append(newest)
