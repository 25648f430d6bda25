"""CheckpointManager: async sharded saves with an atomic commit, and loading the newest valid one.

A save blocks the training loop only while the state that a forward pass changes (module buffers)
and the small values are staged into reused host buffers (:mod:`slurmft.checkpoint.staging`); parameters
and optimizer state are copied while the next step computes, and the optimizer's step pre-hook
waits for that copy (:mod:`slurmft.checkpoint.overlap`; ``fence()`` for loops that change state another
way; ``[checkpoint] overlap = false`` copies everything before ``save()`` returns). A background
thread then runs ``dcp.save`` on a dedicated gloo group (:mod:`slurmft.checkpoint.groups`) through
:class:`slurmft.checkpoint.writer.CommitWriter`, which checksums, fsyncs, writes the manifest and
renames ``step_N.tmp-<id>`` to ``step_N``; with ``[checkpoint] incremental`` it writes only the tensors
that changed since the last save (:mod:`slurmft.checkpoint.incremental`). At most one save is in flight; the next one waits for
it or, with ``on_busy = "skip"``, is skipped by every rank together. After each commit the
coordinator applies retention and calls ``on_commit``.

Loading the newest checkpoint that verifies is :mod:`slurmft.checkpoint.loading`; the saves of
the node-local tier are :mod:`slurmft.checkpoint.tiered_save`; what a save reports
(:class:`SaveStats`) and how it fails (:class:`CheckpointError`) are :mod:`slurmft.checkpoint.outcomes`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import secrets
import threading
import time
import weakref
from pathlib import Path
from typing import Any, ContextManager, Iterator, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from slurmft.rundir import RunDir
from slurmft.safeio import open_dir
from slurmft.checkpoint.config import CheckpointConfig
from slurmft.checkpoint import torch_compat
from slurmft.checkpoint.groups import CheckpointGroups
from slurmft.checkpoint.incremental import TensorIndex
from slurmft.checkpoint.loading import CheckpointLoading
from slurmft.checkpoint.local_tier import LocalTier
from slurmft.checkpoint.outcomes import CheckpointError, OnCommit, SaveStats, describe_failure
from slurmft.checkpoint.overlap import RACED, InFlightCopy, LiveState, optimizers_of, trust
from slurmft.checkpoint.retention import apply_prune, plan_prune, read_references, scan_checkpoint_dirs
from slurmft.checkpoint.save_thread import SaveThread, SaveWaitTimeout
from slurmft.checkpoint.staging import Stager
from slurmft.checkpoint.state import TrainState
from slurmft.checkpoint.tiered_save import TieredSaves
from slurmft.checkpoint.writer import CommitWriter, FaultPlan

__all__ = ["CheckpointConfig", "CheckpointError", "CheckpointManager", "OnCommit", "PhaseWatcher", "SaveStats",
           "describe_failure"]

class PhaseWatcher(Protocol):
    """What the manager asks of the training loop's step watchdog and heartbeat
    (``StepWatchdog.phase``, ``Heartbeat.phase``): a block to run a save or load in, bounded.
    Typed here, not imported, so that the checkpoint engine imports nothing from the loop."""

    def phase(self, label: str, bound_s: float, /) -> ContextManager[None]: ...


log = logging.getLogger(__name__)


def _close_at_exit(ref: "weakref.ref[CheckpointManager]") -> None:
    manager = ref()
    if manager is not None:
        manager.close()


class CheckpointManager(TieredSaves, CheckpointLoading):
    """Saves and restores a :class:`TrainState` under ``<run_dir>/checkpoints``.

    Construct it on every rank (it creates its process groups collectively); call ``save`` /
    ``emergency_save`` / ``load_latest`` on every rank at the same step boundary.

    run_dir: the run directory. config: :class:`CheckpointConfig` (default: its defaults).
    process_group: the ranks that save together (default: the whole world). job_id,
    restart_count: recorded in each manifest (default None). on_commit: called on the
    coordinator as ``on_commit(step, path, stats)`` after each commit (default None).
    watchdog: a :class:`StepWatchdog` that watches saves and loads as phases (default None; the
    attribute may also be set later). heartbeat: a :class:`Heartbeat` in which the same phases
    announce themselves to ``slurmft watch`` with the same bound, so a save or load longer than the
    watcher's hang timeout is waited for (default None; may also be set later).
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: CheckpointConfig | None = None,
        *,
        process_group: Any = None,
        job_id: str | None = None,
        restart_count: int | None = None,
        on_commit: OnCommit | None = None,
        watchdog: PhaseWatcher | None = None,
        heartbeat: PhaseWatcher | None = None,
    ) -> None:
        self.run = RunDir(Path(run_dir))
        # Saves and loads run as watched phases of this watchdog, announced in this heartbeat.
        self.watchdog = watchdog
        self.heartbeat = heartbeat
        self.config = config or CheckpointConfig()
        self.job_id = job_id
        self.restart_count = restart_count
        self.on_commit = on_commit
        self._groups = CheckpointGroups(process_group, timeout_s=self.config.timeout_s)
        self._stager = Stager()
        self._faults = FaultPlan.from_env()
        self._save_thread = SaveThread()
        self._copy: InFlightCopy | None = None  # the overlapped staging copy of the last save
        self._guarded: list[weakref.ref[torch.optim.Optimizer]] = []
        self._guard_handles: list[Any] = []
        self._overlap_refused = False  # set once a change raced a copy: copy before returning
        self._tensors = self._tensor_index()  # incremental saves: where the last save's tensors lie
        self._stats: list[SaveStats] = []
        self._lock = threading.Lock()
        self._last_committed: int | None = None
        self.skipped = 0
        # (step, reason) of every checkpoint the last load_latest() passed over (same on every rank)
        self.load_skipped: list[tuple[int, str]] = []
        self.loaded_tier: str | None = None
        self._saves_started = 0
        self._tmp_nonce = self._groups.broadcast(secrets.token_hex(8) if self._groups.is_coordinator else None)
        if self._groups.is_coordinator:
            self.run.checkpoints.mkdir(parents=True, exist_ok=True)
        self._tier = (LocalTier(self.run, self.config.local_dir, groups=self._groups,
                                keep_local=self.config.keep_local, replicate=self.config.replicate,
                                faults=self._faults)
                      if self.config.local_dir else None)
        self._last_shared: int | None = None  # newest step copied to the run dir by this process
        self._local_only = None  # the last local commit not yet copied (a _LocalCommit)
        atexit.register(_close_at_exit, weakref.ref(self))

    def _tensor_index(self) -> TensorIndex | None:
        if not self.config.incremental:
            return None
        if not torch_compat.FAST_SHARD_WRITE:  # references need DCP's private _StorageInfo
            log.warning("[checkpoint] incremental needs torch's private DCP writer API, which this torch "
                        "lacks: every save is written whole")
            return None
        return TensorIndex(self.config.full_every)

    # ------------------------------------------------------------------ saving

    @property
    def stats(self) -> list[SaveStats]:
        with self._lock:
            return list(self._stats)

    @property
    def staging_allocations(self) -> int:
        return self._stager.allocations

    def staging_pointers(self) -> list[int]:
        return self._stager.buffer_pointers()

    def due(self, step: int) -> bool:
        """Whether ``step`` is a periodic checkpoint step (every ``interval`` steps)."""
        return step > 0 and step % self.config.interval == 0

    def save(self, step: int, state: TrainState, *, block: bool = False) -> bool:
        """Checkpoint ``state`` as ``step``; returns False if skipped (busy or already committed).

        Call at a step boundary on every rank. With ``block`` it returns once committed in the run
        directory (with the node-local tier: copied there too) and raises :class:`CheckpointError`
        if the save failed. Waiting for the previous save is
        bounded by ``save_timeout_s`` (:class:`CheckpointError` naming that save).
        """
        with self._watched(f"checkpoint save of step {step}"):
            return self._save(step, state, block)

    def _save(self, step: int, state: TrainState, block: bool) -> bool:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._groups.closed:
            raise RuntimeError("CheckpointManager.save called after close()")
        entered = time.perf_counter()
        if self.config.on_busy == "skip" and not block and self._groups.agree_busy(self._in_flight()):
            self.skipped += 1  # skipping must be unanimous: one all-reduce of "still busy?"
            if self._groups.is_coordinator:
                log.info("checkpoint step %d skipped: the previous save is still in flight", step)
            return False
        # Otherwise each rank waits for its own previous save, so no collective is needed: the
        # tmp id is a nonce agreed at construction plus the per-manager save count, identical on
        # every rank as long as they all call save() (the contract). A rank that did not would be
        # caught by CommitWriter.finish, which refuses mixed dirs.
        self._saves_started += 1
        tmp_id = f"{self._tmp_nonce}-{self._saves_started:x}"
        waiting = time.perf_counter()
        self.wait()
        waited_s = time.perf_counter() - waiting
        if step == self._last_committed:
            if block and self._tier is not None and self._last_shared != step:
                self._copy_pending(step)  # the job is ending: this step must reach the run dir
            return False
        state.step = step
        what = f"checkpoint save of step {step}"
        light = state.light_state()  # before staging: a failure here leaves no copy in flight
        optimizers = optimizers_of(state.optimizer)
        copy = None
        # No optimizer: nothing would fence the copy before the loop changes the parameters.
        if self.config.overlap and optimizers and not self._overlap_refused:
            heavy, copy = self._stager.stage_overlapped(state.heavy_state(),
                                                        LiveState(state.model, optimizers), what)
        else:
            heavy = self._stager.stage(state.heavy_state())
        staged = {**heavy, **light}
        blocking_s = time.perf_counter() - entered
        timing = (entered, blocking_s, waited_s)
        try:
            if self._tier is not None:
                to_shared = self._shared_due(step, block)
                self._save_thread.submit(
                    lambda: self._persist_tiered(step, staged, tmp_id, timing, copy, to_shared), what=what)
            else:
                self._save_thread.submit(lambda: self._persist(step, staged, tmp_id, timing, copy), what=what)
        except BaseException:
            if copy is not None:
                copy.finish(self.config.save_timeout_s)  # nobody else will; the live state is free again
            raise
        if copy is not None:
            self._guard(optimizers)
        self._copy = copy
        if block:
            self._wait_unwatched()
            last = self.stats[-1]
            if last.step != step:  # the save thread lost it (logged): never report another save's result
                raise CheckpointError(f"checkpoint step {step} failed: no result recorded (see the log)")
            if not last.committed:
                raise CheckpointError(f"checkpoint step {step} failed: {last.error}")
            if last.tier != "shared":  # a blocking save (the job is ending) must reach the run dir
                raise CheckpointError(f"checkpoint step {step} is committed on the node-local tier only: "
                                      f"its copy to {self.run.checkpoints} failed (see the log)")
        return True

    def fence(self) -> None:
        """Return once the last save no longer reads the live state (its overlapped copy is
        complete), waiting at most ``save_timeout_s`` (then :class:`CheckpointError`).

        ``optimizer.step()`` of a saved :class:`TrainState` calls this itself (a step pre-hook).
        Call it before changing parameters, buffers or optimizer state any other way right after
        a save (an EMA update, weights set by hand): a save whose copy saw such a change fails
        (logged, not committed) rather than commit a state that no step had.
        """
        copy = self._copy
        if copy is None:
            return
        if not copy.done:
            with self._watched(f"waiting for the state copy of {copy.what}"):
                try:
                    copy.fence(self.config.save_timeout_s)
                except SaveWaitTimeout as exc:
                    raise CheckpointError(str(exc)) from None
        self._copy = None

    def _guard(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Make each optimizer's ``step()`` fence the copy in flight (hooked once per optimizer)."""
        if [o() for o in self._guarded] == optimizers:
            return
        self._unguard()
        manager = weakref.ref(self)

        def fence_before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            alive = manager()
            if alive is not None:
                alive.fence()

        self._guard_handles = [o.register_step_pre_hook(fence_before_step) for o in optimizers]
        self._guarded = [weakref.ref(o) for o in optimizers]

    def _unguard(self) -> None:
        for handle in self._guard_handles:
            handle.remove()
        self._guard_handles, self._guarded = [], []

    def emergency_save(self, step: int, state: TrainState) -> SaveStats | None:
        """Synchronous save (waits for any save in flight first); returns once committed in the run
        directory (with the node-local tier, a step committed there only is copied now)."""
        self.wait()
        if step == self._last_committed:
            if self._tier is not None and self._last_shared != step:
                self._copy_pending(step)
                return self.stats[-1]
            return None
        self.save(step, state, block=True)
        return self.stats[-1]

    def wait(self) -> None:
        """Block until the save in flight (if any) has committed or failed, at most
        ``save_timeout_s``; past that, :class:`CheckpointError` names the save still in flight."""
        if not self._in_flight():
            return
        with self._watched(f"waiting for the {self._save_thread.in_flight or 'checkpoint save'} in flight"):
            self._wait_unwatched()

    def _wait_unwatched(self) -> None:
        """``wait()`` inside a phase already announced (a blocking save's own)."""
        try:
            self._save_thread.wait(self.config.save_timeout_s)
        except SaveWaitTimeout as exc:
            raise CheckpointError(str(exc)) from None

    @contextlib.contextmanager
    def _watched(self, label: str) -> Iterator[None]:
        """Run the block as a phase of the step watchdog and announce it in the heartbeat, for the
        managers that have them, both bounded by ``save_timeout_s`` + 60 s."""
        bound = self.config.save_timeout_s + 60.0
        with contextlib.ExitStack() as stack:
            if self.watchdog is not None:
                stack.enter_context(self.watchdog.phase(label, bound))
            if self.heartbeat is not None:
                stack.enter_context(self.heartbeat.phase(label, bound))
            yield

    def close(self) -> None:
        """Finish the save in flight, stop the save thread, destroy the process groups. Idempotent.

        Runs at interpreter exit (``atexit``, while Python is still whole) for a manager the script
        did not close, so a script that ends with a save in flight commits it and exits 0 instead
        of having the save thread and gloo workers killed inside torch (SIGABRT, see
        :mod:`slurmft.checkpoint.groups`).
        """
        self._unguard()  # the optimizer may outlive this manager
        if not self._save_thread.stop(self.config.exit_timeout_s):
            # The abandoned save still sits in a collective of these groups: destroying them
            # could block as long as it does. The process is on its way out; let it go.
            return
        self._groups.destroy()

    def _in_flight(self) -> bool:
        return self._save_thread.busy

    def _persist(self, step: int, staged: dict[str, Any], tmp_id: str,
                 timing: tuple[float, float, float], copy: InFlightCopy | None) -> None:
        entered, blocking_s, waited_s = timing
        final = self.run.checkpoint(step)
        before_write = None
        if copy is not None:
            copy.finish(self.config.save_timeout_s)
            before_write = functools.partial(trust, copy)
        delta = self._tensors.begin(self.run.checkpoints, step) if self._tensors is not None else None
        writer = CommitWriter(final, tmp_id, step, self._groups.world_size, job_id=self.job_id,
                              restart_count=self.restart_count, thread_count=self.config.thread_count,
                              faults=self._faults, before_write=before_write, delta=delta)
        error = None
        try:
            dcp.save(staged, storage_writer=writer, process_group=self._groups.io,
                     no_dist=not self._groups.distributed)
        except (Exception, CheckpointException) as exc:  # reported in stats and the log; training goes on
            error = describe_failure(exc)
            log.error("checkpoint step %d failed: %s", step, error)
        stats = SaveStats(step, blocking_s, time.perf_counter() - entered, writer.bytes_written,
                          error is None, error, waited_s,
                          copied_s=None if copy is None or copy.copied_s is None else copy.started - entered + copy.copied_s,
                          fenced_s=0.0 if copy is None else copy.fenced_s,
                          bytes_reused=0 if delta is None else delta.bytes_reused)
        with self._lock:
            self._stats.append(stats)
        if error is not None:
            if RACED in error and not self._overlap_refused:
                self._overlap_refused = True
                log.warning("checkpoint step %d: the state changed while it was being copied; from now "
                            "on every save copies the state before save() returns (call fence() "
                            "before changing state outside optimizer.step() to keep the overlap)", step)
            return
        self._last_committed = step
        if self._tensors is not None and delta is not None:
            self._tensors.committed(delta)
        if self._groups.is_coordinator:
            log.info("checkpoint step %d committed: blocked %.3fs, total %.3fs", step, blocking_s, stats.total_s)
            self._after_commit(step, final, stats)

    def _after_commit(self, step: int, final: Path, stats: SaveStats) -> None:
        try:
            ckpt_fd = open_dir(self.run.checkpoints)  # once: the scan and the deletion see one directory
            try:
                committed, tmp_dirs = scan_checkpoint_dirs(self.run.root, ckpt_fd=ckpt_fd)
                plan = plan_prune(committed, step, tmp_dirs, self.config.retention(),
                                  read_references(ckpt_fd, committed))
                refused = lambda line: log.warning("retention: %s", line)  # noqa: E731
                for path in apply_prune(self.run.root, plan, refused, ckpt_fd=ckpt_fd):
                    log.info("retention removed %s", path)
            finally:
                os.close(ckpt_fd)
        except OSError as exc:
            log.error("retention after step %d failed: %s", step, exc)
        self._notify(step, final, stats)

    def _notify(self, step: int, final: Path, stats: SaveStats) -> None:
        if self.on_commit is not None:
            try:
                self.on_commit(step, final, stats)
            except Exception:
                log.exception("on_commit callback failed for step %d", step)
