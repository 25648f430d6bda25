"""Job and node state names -> (base state, flags), identical for every release.

Slurm 22.05 spells a job's state as one string, and that string is a *flag* name when a flag is
set (``COMPLETING``, ``REQUEUED``, ``CONFIGURING``...: Slurm prints the flag instead of the base).
From data_parser v0.0.40 (23.11) a state is a list: the base name plus the flag names. This module
turns either into a base :class:`JobState` and a frozenset of flags; the table
``_FLAG_IMPLIES_BASE`` says which base a lone flag stands for. Node states work the same way
(22.05: lower-case base plus ``state_flags``; 23.02+: ``["IDLE", "DRAIN"]``).
"""

from __future__ import annotations

from slurmft.slurm.client import JobState, NodeState
from slurmft.slurm.jsonshape import Where

_CONTROLLER_BASES = frozenset(s.value for s in JobState) - {JobState.REQUEUED.value}

# A 22.05 state string naming a flag: which base the job is in while that flag is shown.
_FLAG_IMPLIES_BASE = {
    "COMPLETING": JobState.RUNNING,  # still holds its nodes; the epilog is running
    "CONFIGURING": JobState.RUNNING,
    "POWER_UP_NODE": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "SPECIAL_EXIT": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "LAUNCH_FAILED": JobState.PENDING,
    "STOPPED": JobState.SUSPENDED,
    "REVOKED": JobState.CANCELLED,
}

_NODE_BASES = {s.value: s for s in NodeState} | {"ALLOC": NodeState.ALLOCATED, "MIX": NodeState.MIXED}


def job_state(names: list[str], where: Where, *, accounting: bool = False) -> tuple[JobState, frozenset[str]]:
    """Base state and flags of a job from its state names.

    ``accounting`` is True for sacct records, where ``REQUEUED`` is the final state of one run
    (the job itself went back to the queue); on the controller side it is a flag of a PENDING job.
    """
    bases = _CONTROLLER_BASES | ({JobState.REQUEUED.value} if accounting else set())
    # sacct text says "CANCELLED by 0"; only the first word is the state.
    names = [n.split(" ", 1)[0] for n in names if n]
    if accounting and JobState.REQUEUED.value in names:
        # 24.11 sacct: ["PENDING", "REQUEUED"] for a run that ended by going back to the queue
        return JobState.REQUEUED, frozenset(n for n in names if n != JobState.REQUEUED.value)
    found = [n for n in names if n in bases]
    flags = frozenset(n for n in names if n not in bases)
    if found:
        return JobState(found[0]), flags
    for name in names:
        if name in _FLAG_IMPLIES_BASE:
            return _FLAG_IMPLIES_BASE[name], flags
    raise where.unknown("job state", names)


def node_state(names: list[str], extra_flags: list[str], where: Where) -> tuple[NodeState, frozenset[str]]:
    """Base state and flags of a node; ``extra_flags`` is 22.05's separate ``state_flags``."""
    upper = [n.upper() for n in names] + [f.upper() for f in extra_flags]
    base = next((_NODE_BASES[n] for n in upper if n in _NODE_BASES), None)
    if base is None:
        raise where.unknown("node state", upper)
    flags = frozenset(n for n in upper if n not in _NODE_BASES)
    return base, flags
