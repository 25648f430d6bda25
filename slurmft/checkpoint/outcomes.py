"""What a checkpoint save reports and how the engine fails: :class:`SaveStats` (one save, timed),
the ``on_commit`` callback's type, :class:`CheckpointError` and the one-line description of a DCP
failure."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch.distributed.checkpoint.api import CheckpointException


@dataclass(frozen=True)
class SaveStats:
    """One save, timed from the ``save()`` call (``CheckpointManager.stats``).

    ``step``: the checkpoint's step. ``committed``: the save is durable under its final name.

    ``blocking_s``: how long ``save()`` held the training loop (agreement, ``waited_s`` spent
    waiting for the previous save, and staging). ``total_s``: until committed (or failed).
    ``copied_s``: until the state copy was complete (overlapped staging; else None).
    ``fenced_s``: how long the loop waited for that copy afterwards (optimizer step, ``fence()``).
    ``stall_s``: all the loop lost to this save (``blocking_s`` + ``fenced_s``).
    ``bytes_written``: this rank's shard files. ``bytes_reused``: this rank's tensor records not
    written again but referenced in an older checkpoint (incremental saves). ``error``: set when
    the save failed.

    ``tier``: where the checkpoint is committed: "shared" (the run directory) or, with the
    node-local tier, "local" when it was not (yet) copied there. ``local_s``: with the node-local
    tier, until durable on every node's local disk (replicas included); ``total_s`` then runs
    until the copy to the run directory was committed, when there was one.
    """

    step: int
    blocking_s: float
    total_s: float
    bytes_written: int
    committed: bool
    error: str | None = None
    waited_s: float = 0.0
    copied_s: float | None = None
    fenced_s: float = 0.0
    bytes_reused: int = 0
    tier: str = "shared"
    local_s: float | None = None

    @property
    def stall_s(self) -> float:
        return self.blocking_s + self.fenced_s


OnCommit = Callable[[int, Path, SaveStats], None]


class CheckpointError(RuntimeError):
    """A synchronous save failed, or a verified checkpoint could not be loaded into this model."""


def describe_failure(exc: BaseException) -> str:
    """One line for a DCP failure: each failing rank and its exception, without tracebacks."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _tb) in sorted(exc.failures.items()))
    return f"{type(exc).__name__}: {exc}"
