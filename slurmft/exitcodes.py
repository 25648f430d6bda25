"""Exit codes shared by the training process, the sbatch template and the watcher.

These numbers are the protocol between a training step and whoever decides what happens next
(the launcher's self-requeue, the watcher's give-up rule). They are defined here and nowhere
else; the template's comments name them, and its own early exits are tested against these
values (tests/unit/test_train_sbatch.py). Torch-free.
"""

from __future__ import annotations

OK = 0
"""Training finished (or this segment ended cleanly)."""

REQUEUE = 85
"""Preempted or out of time: every rank joined one emergency checkpoint; requeue me."""

NO_REQUEUE = 86
"""Running again would fail the same way (bad input, incompatible checkpoint, repeated NaNs)."""

HANG = 87
"""The step-time watchdog fired: a step (often a collective) hung; stacks are in the job log."""

REFORM = 88
"""In-allocation mode: the allocation's generation moved past the one this rank started in (the
launcher fenced a node or decided a restart), so the rank ended itself at once instead of waiting
in a collective that cannot be aborted (gloo) until the process-group timeout. Not a failure of
the run: the launcher re-forms the world in the allocation (a spare, a smaller world, or the same
nodes again) and the ranks resume from the newest valid checkpoint."""

FENCED = 89
"""In-allocation mode, a node's torchrun agent (``slurmft.train.rdzv_leave``): the launcher fenced
this node, so the agent left the rendezvous and ended without joining another round. Its node
task and step end with it; the launcher, which fenced the node, expects it."""

NAMES: dict[int, str] = {OK: "OK", REQUEUE: "REQUEUE", NO_REQUEUE: "NO_REQUEUE", HANG: "HANG",
                         REFORM: "REFORM", FENCED: "FENCED"}


def describe(code: int) -> str:
    """``"REQUEUE (85)"`` for a known code, ``"exit 3"`` for anything else."""
    name = NAMES.get(code)
    return f"{name} ({code})" if name else f"exit {code}"
