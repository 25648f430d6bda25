"""The saves of the node-local tier (``[checkpoint] local_dir``, :mod:`slurmft.checkpoint.local_tier`):
a save committed on the nodes' disks, then copied to the run directory every ``shared_interval``
steps (always for a blocking save), and the copy of a step committed locally only when the job
ends. Methods of :class:`slurmft.checkpoint.manager.CheckpointManager`, from :class:`TieredSaves`."""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from slurmft.rundir import RunDir
from slurmft.checkpoint.config import CheckpointConfig
from slurmft.checkpoint.groups import CheckpointGroups
from slurmft.checkpoint.local_tier import LocalTier
from slurmft.checkpoint.manifest import Manifest
from slurmft.checkpoint.outcomes import CheckpointError, SaveStats, describe_failure
from slurmft.checkpoint.overlap import RACED, InFlightCopy, trust
from slurmft.checkpoint.save_thread import SaveThread
from slurmft.checkpoint.writer import CommitWriter, FaultPlan

# The manager's log: these lines were always its own (filters and tests select them by this name).
log = logging.getLogger("slurmft.checkpoint.manager")


@dataclass(frozen=True)
class _LocalCommit:
    """What the copy of a checkpoint committed on the node-local tier to the run dir needs."""

    step: int
    tmp_id: str
    own: tuple[Any, ...]
    manifest: Manifest
    metadata: bytes
    entered: float


class TieredSaves:
    """The node-local tier's half of :class:`slurmft.checkpoint.manager.CheckpointManager` (a base
    class of it): the attributes below are the manager's, set by its constructor."""

    run: RunDir
    config: CheckpointConfig
    job_id: str | None
    restart_count: int | None
    _groups: CheckpointGroups
    _tier: LocalTier | None
    _faults: FaultPlan
    _save_thread: SaveThread
    _lock: threading.Lock
    _stats: list[SaveStats]
    _overlap_refused: bool
    _last_committed: int | None
    _last_shared: int | None
    _local_only: _LocalCommit | None
    wait: Callable[[], None]
    _notify: Callable[[int, Path, SaveStats], None]
    _after_commit: Callable[[int, Path, SaveStats], None]

    if TYPE_CHECKING:  # CheckpointManager.stats, which these methods read
        @property
        def stats(self) -> list[SaveStats]: ...

    def _shared_due(self, step: int, block: bool) -> bool:
        """Whether this save is copied to the run dir: blocking saves (an emergency save before the
        job ends), a process's first, and one ``shared_interval`` steps after the last copied."""
        interval = self.config.shared_interval
        return (block or interval is None or self._last_shared is None
                or step - self._last_shared >= interval)

    def _persist_tiered(self, step: int, staged: dict[str, Any], tmp_id: str,
                        timing: tuple[float, float, float], copy: InFlightCopy | None, to_shared: bool) -> None:
        """The node-local tier's save (:mod:`slurmft.checkpoint.local_tier`): commit on the nodes' disks,
        then, when ``to_shared``, copy to the run directory."""
        entered, blocking_s, waited_s = timing
        tier = self._tier
        assert tier is not None
        before_write = None
        if copy is not None:
            copy.finish(self.config.save_timeout_s)
            before_write = functools.partial(trust, copy)
        writer = CommitWriter(tier.checkpoint(step), tmp_id, step, self._groups.world_size, job_id=self.job_id,
                              restart_count=self.restart_count, thread_count=self.config.thread_count,
                              faults=self._faults, before_write=before_write, commit=False,
                              recorded_as=self.run.checkpoint(step))
        error = None
        manifest: Manifest | None = None
        metadata: bytes | None = None
        try:
            dcp.save(staged, storage_writer=writer, process_group=self._groups.io,
                     no_dist=not self._groups.distributed)
            # Every rank gets here: DCP raised on all of them or on none.
            manifest, metadata, problems, unreplicated = tier.commit_local(step, tmp_id, writer.own_files,
                                                                            writer.manifest)
            error = "; ".join(problems) or None
            if error is None and unreplicated:  # not what local_dir promises: copy this one now
                log.warning("checkpoint step %d: replica(s) not kept (%s); copying it to the run dir",
                            step, "; ".join(unreplicated))
                to_shared = True
            if error is None:
                tier.after_local_commit(step)
        except (Exception, CheckpointException) as exc:  # reported in stats and the log; training goes on
            error = error or describe_failure(exc)
        local_s = time.perf_counter() - entered
        stats = SaveStats(step, blocking_s, local_s, writer.bytes_written, error is None, error, waited_s,
                          copied_s=None if copy is None or copy.copied_s is None else copy.started - entered + copy.copied_s,
                          fenced_s=0.0 if copy is None else copy.fenced_s, tier="local", local_s=local_s)
        if error is not None or manifest is None or metadata is None:
            log.error("checkpoint step %d failed: %s", step, error)
            with self._lock:
                self._stats.append(stats)
            if error is not None and RACED in error and not self._overlap_refused:
                self._overlap_refused = True
                log.warning("checkpoint step %d: the state changed while it was being copied; from now "
                            "on every save copies the state before save() returns", step)
            return
        self._last_committed = step
        self._local_only = _LocalCommit(step, tmp_id, writer.own_files, manifest, metadata, entered)
        if self._groups.is_coordinator:
            log.info("checkpoint step %d committed on the local tier: blocked %.3fs, durable %.3fs",
                     step, blocking_s, local_s)
            self._notify(step, tier.checkpoint(step), stats)
        if to_shared:
            stats = self._copy_to_run_dir(stats)
        with self._lock:
            self._stats.append(stats)

    def _copy_to_run_dir(self, stats: SaveStats) -> SaveStats:
        """Copy the last local commit to the run dir (every rank, save thread); its stats after."""
        tier, pending = self._tier, self._local_only
        assert tier is not None and pending is not None and pending.step == stats.step
        step = pending.step
        try:
            problems = tier.copy_to_shared(step, pending.tmp_id, pending.own, pending.manifest, pending.metadata)
        except (Exception, CheckpointException) as exc:
            problems = [describe_failure(exc)]
        if problems:
            log.error("checkpoint step %d: copy to the run directory failed (it stays on the local "
                      "tier only): %s", step, "; ".join(problems))
            return stats
        self._last_shared, self._local_only = step, None
        stats = replace(stats, tier="shared", total_s=time.perf_counter() - pending.entered)
        if self._groups.is_coordinator:
            log.info("checkpoint step %d committed in the run directory: total %.3fs", step, stats.total_s)
            self._after_commit(step, self.run.checkpoint(step), stats)
        return stats

    def _copy_pending(self, step: int) -> None:
        """A blocking save of a step already committed locally only: copy it to the run dir now
        (all ranks), or raise :class:`CheckpointError`."""
        pending = self._local_only
        if pending is None or pending.step != step:
            raise CheckpointError(f"checkpoint step {step} is on the node-local tier only and this "
                                  f"process has no record of its files to copy")
        last = next(s for s in reversed(self.stats) if s.step == step)

        def job() -> None:
            copied = self._copy_to_run_dir(last)
            with self._lock:
                self._stats.append(copied)

        self._save_thread.submit(job, what=f"copy of checkpoint step {step} to the run directory")
        self.wait()
        if self.stats[-1].tier != "shared":
            raise CheckpointError(f"checkpoint step {step} is committed on the node-local tier only: "
                                  f"its copy to {self.run.checkpoints} failed (see the log)")
