"""``[checkpoint]`` settings: the one dataclass the training job and ``slurmft ckpt prune`` share.

Torch-free on purpose: the cluster side (``slurmft ckpt prune`` on a login node) reads the same
section the job reads, so an admin prunes with exactly the job's retention policy. Values come
from the usual layers (:mod:`slurmft.config`): defaults < slurmft.toml < ``SLURMFT_CHECKPOINT_*``
< overrides.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from slurmft.config import load_section
from slurmft.checkpoint.retention import RetentionPolicy

SECTION = "checkpoint"


@dataclass(frozen=True)
class CheckpointConfig:
    """``[checkpoint]`` settings (slurmft.toml, ``SLURMFT_CHECKPOINT_<FIELD>``, or overrides).

    interval: steps between periodic saves (500). keep_last: newest checkpoints kept (3).
    keep_every: also keep every M-th step (None). milestones: steps never pruned (()).
    on_busy: a save while the previous one is in flight "wait"s for it or is "skip"ped ("wait").
    thread_count: writer threads (files) per rank (1). timeout_s: the checkpoint groups'
    collective timeout (1800). save_timeout_s: longest the training loop waits for a save in
    flight, then CheckpointError names it (3600). exit_timeout_s: longest close() (the exit)
    waits for a save still in flight before abandoning it (60). overlap: ``save()`` returns before
    parameters and optimizer state are copied; the copy runs beside the next forward and backward,
    and ``optimizer.step()`` waits for it (True; False: the copy is done when ``save()`` returns).
    incremental: tensors whose bytes did not change since the last save are not written again;
    the checkpoint references the older one's records (False). full_every: with ``incremental``,
    every N-th save (and a process's first) is written whole, so old checkpoints can be pruned (8).
    local_dir: node-local directory (NVMe) of the local tier; ``{node}`` is replaced by the node's
    name (None: every save goes straight to the run directory). With it, a save commits on the
    local disks first (each node's own shards, plus a replica of one other node's), then is
    copied to the run directory in the background (:mod:`slurmft.checkpoint.local_tier`).
    shared_interval: with ``local_dir``, a committed local checkpoint is copied to the run
    directory when at least this many steps passed since the last one copied (None: every save;
    a process's first save and blocking saves are always copied). keep_local: local checkpoints
    each node keeps (2). replicate: copy each node's shards to one other node's local tier (True).
    """

    interval: int = 500  # steps between periodic saves (see CheckpointManager.due)
    keep_last: int = 3
    keep_every: int | None = None
    milestones: tuple[int, ...] = ()
    on_busy: Literal["wait", "skip"] = "wait"
    thread_count: int = 1  # writer threads per rank (files per rank)
    timeout_s: float = 1800.0  # collectives of the checkpoint groups
    # Longest the training loop waits for a save in flight (save, wait, emergency_save, load):
    # past it CheckpointError names the save; a step watchdog given to the manager watches the
    # same phases for this long plus a minute.
    save_timeout_s: float = 3600.0
    # Longest close() (and so the process exit) waits for a save still in flight, e.g. one stuck
    # on a dead peer's collective; past it the save is abandoned (its tmp dir is swept later).
    exit_timeout_s: float = 60.0
    # Stage parameters and optimizer state while the next step computes (CheckpointManager.fence).
    overlap: bool = True
    # Write only the tensors that changed since the last save (frozen layers are referenced).
    incremental: bool = False
    full_every: int = 8
    # Node-local tier (slurmft.checkpoint.local_tier): commit locally, copy to the run dir behind.
    local_dir: str | None = None
    shared_interval: int | None = None
    keep_local: int = 2
    replicate: bool = True

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if self.full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {self.full_every}")
        if self.shared_interval is not None and self.shared_interval < 1:
            raise ValueError(f"shared_interval must be >= 1, got {self.shared_interval}")
        if self.keep_local < 1:
            raise ValueError(f"keep_local must be >= 1, got {self.keep_local}")
        if self.local_dir is not None:
            if not self.local_dir.strip() or not self.local_dir.startswith("/"):
                raise ValueError(f"local_dir must be an absolute path, got {self.local_dir!r}")
            if self.incremental:
                # A reference names ../step_M of the same tier; tiers prune independently.
                raise ValueError("local_dir cannot be combined with incremental = true (yet)")
        if self.thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {self.thread_count}")
        for name in ("timeout_s", "save_timeout_s", "exit_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self.retention()  # validates keep_last / keep_every / milestones

    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(self.keep_last, self.keep_every, frozenset(self.milestones))

    @classmethod
    def load(cls, config_file: str | Path | None = None, *, environ: Mapping[str, str] | None = None,
             **overrides: Any) -> "CheckpointConfig":
        """Defaults < ``[checkpoint]`` of the config file < environment < ``overrides`` (None = not given)."""
        return load_section(cls, SECTION, config_file=config_file, environ=environ, overrides=overrides)
