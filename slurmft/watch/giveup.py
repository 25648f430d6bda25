"""The give-up rules: when a run must be held rather than restarted again.

Planned ends (``detect.PLANNED``: a time limit, a preemption, a pre-flight requeue) are restarts,
never faults: they count toward no rule, so a run chunked 100 times by its time limit finishes.
Faults count toward ``max_restarts`` (fault restarts in total) and their cause's
``max_restarts_per_cause``, and the crash-loop rule judges progress: ``crash_loop_restarts``
fault restarts in a row with no newer committed checkpoint (a newer one since breaks the loop,
whatever the planned ends between). Pure functions of the run's state and the config.
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
    if detect.planned(cause):
        return None
    faults = fault_restarts(state)
    if faults >= config.max_restarts:
        return f"{faults} restarts for faults, the most allowed (max_restarts)"
    if state.restarts_by_cause.get(cause, 0) >= config.max_restarts_per_cause:
        return f"{state.restarts_by_cause[cause]} restarts for {cause} (max_restarts_per_cause)"
    if cause in detect.FAULTS:
        recent = state.ckpt_at_recovery[-config.crash_loop_restarts:]
        if len(recent) >= config.crash_loop_restarts and all(s == newest for s in recent):
            return (f"crash loop: no newer checkpoint than step {newest} across "
                    f"{config.crash_loop_restarts} restarts")
    return None
