"""``Run``: the training-loop helper that wires every in-job piece of slurmft around a user's loop.

    with Run(model, optimizer, scheduler=sched, sampler=sampler) as run:
        for step in run.steps(total_steps):
            loss = compute_loss(batch_for(step)); loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if run.report(loss=loss, grad_norm=norm):   # False: the guard dropped this update
                optimizer.step()
            scheduler.step(); optimizer.zero_grad()

Step numbering is 1-based: ``steps(total)`` yields ``restored + 1 .. total``; step ``k`` trains the
k-th batch, and checkpoint ``k`` (``save(k)``) holds the state *after* step ``k``, so a run resumed
from it continues with step ``k + 1``. ``run.step`` is the number of completed steps.

What ``Run`` owns (each piece stays usable alone: ``run.checkpoints``, ``run.guard``...):
* start (``with``): job identity (``JobEnv``), run dir check, ``Segment``, ``TrainState``, in
  in-allocation mode the allocation watch (:mod:`slurmft.train.alloc_watch`: a world the
  launcher re-forms ends this rank at once with exit 88), ``CheckpointManager`` and resume from
  the newest valid checkpoint, journaled as ``segment_start`` with ``restored_step``, ``load_s``
  and ``load_bytes``; heartbeat (created first: the load announces itself in it), watchdog,
  signal handlers. ``phase()``: a long phase of the user's own (an evaluation) with its bound.
* ``report()``: ONE all-reduce (SUM over ranks) of loss, gradient norm and "a preemption signal
  arrived", so the guard judges the same numbers on every rank and the preemption decision costs
  no extra collective. A verdict other than OK clears the gradients (``zero_grad(set_to_none=True)``)
  so an ``optimizer.step()`` that follows anyway changes nothing.
* the step boundary (the code after the loop body): rollback or give up (exit 86) as the guard said,
  a ``loss`` event, the heartbeat, the periodic save, and on preemption one emergency save and exit
  85. Every ending journals ``segment_end`` first, because torchrun turns any worker's exit code
  into 1 and the sbatch template reads the real one back from the journal.
* the end of ``steps()``: the final save (skipped when that step is committed already) and
  ``DONE``, written once.
Exits print one line from rank 0 and no traceback (``SystemExit``). torchrun's own
"FAILED ... exitcode 85" report and its traceback come from the launcher process and cannot be
suppressed from inside the ranks without exiting 0, which would hide the requeue from any
launcher that does not read the journal.

This module holds the start, the pieces and the loop; the step boundary is
:mod:`slurmft.train.run_boundary` and the endings :mod:`slurmft.train.run_endings` (base classes
of ``Run``).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from slurmft import exitcodes, journal
from slurmft.config import ConfigError, load_section
from slurmft.rundir import RUN_DIR_ENV, RunDir
from slurmft.train.alloc_watch import AllocationWatch, watch_allocation
from slurmft.train.boundary import BoundaryCheck, step_generator, user_site
from slurmft.checkpoint.manager import CheckpointError, CheckpointManager
from slurmft.checkpoint.config import CheckpointConfig
from slurmft.train.guards import GuardConfig, GuardResult, StepGuard
from slurmft.train.busy import ForwardTimer
from slurmft.train.heartbeat import Heartbeat
from slurmft.checkpoint.manifest import ManifestError, read_manifest
from slurmft.train.preemption import PreemptionConfig, PreemptionHandler
from slurmft.train.resume_audit import ResumeAudit
from slurmft.train.run_config import RunConfig
from slurmft.train.runtime import JobEnv, JobEnvError, RunDirError, Segment, check_run_dir_writable
from slurmft.checkpoint.state import TrainState
from slurmft.train.watchdog import StepWatchdog
from slurmft.train.phases import RestartPhases
from slurmft.train.run_boundary import StepBoundary
from slurmft.train.run_endings import RunEndings, fail

_IMPORTED_AT = time.time()  # torch and slurmft's checkpoint engine imported: restart_phases' torch_imported

_ADVICE = ("Draw each step's random batch inside the step (from run.rng(step), or the global RNG), "
           "never before the loop or after run.report() for the next step.")


class Run(StepBoundary, RunEndings):
    """Resume, preemption, heartbeat, watchdog, guard, periodic and final saves, ``DONE`` — around a loop.

    Arguments (every one but ``model`` optional):
      model, optimizer, scheduler, sampler, extras: what a checkpoint holds (:class:`TrainState`;
        the sampler and scheduler need ``state_dict``/``load_state_dict`` returning plain JSON data;
        ``extras`` maps names to such objects, a ``torch.amp.GradScaler`` for one, or to plain JSON
        values). ``segment_start`` journals what is carried (``carries``).
      run_dir: the run directory (default ``$SLURMFT_RUN_DIR``; missing or not writable: exit 86).
      checkpoint, guards, config: :class:`CheckpointConfig`, :class:`GuardConfig`,
        :class:`RunConfig`; default: loaded from ``config_file``/slurmft.toml and ``SLURMFT_*``.
      process_group: the group the loop trains on (default: the whole world).
      device: where ``report()``'s all-reduce runs (default: the current CUDA device for NCCL, else
        CPU); also ``rng()``'s default device.
      info: extra fields for the ``segment_start`` event.
      env: a :class:`JobEnv` (default: read from the environment).

    Use it as a context manager (or ``start()`` / ``close()``) on every rank, after
    ``init_process_group`` and after wrapping the model (DDP, ``fully_shard``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 scheduler: Any = None, sampler: Any = None, extras: dict[str, Any] | None = None,
                 run_dir: str | Path | None = None, config_file: str | Path | None = None,
                 checkpoint: CheckpointConfig | None = None, guards: GuardConfig | None = None,
                 config: RunConfig | None = None, process_group: Any = None,
                 device: torch.device | str | None = None, info: Mapping[str, Any] | None = None,
                 env: JobEnv | None = None) -> None:
        self.state = TrainState(model, optimizer, scheduler, sampler, extras)
        self._run_dir_arg = run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV)
        try:
            self.checkpoint_config = checkpoint or CheckpointConfig.load(config_file)
            self.guard_config = guards or load_section(GuardConfig, "guards", config_file=config_file)
            self.config = config or RunConfig.load(config_file)
            self.preemption_config = PreemptionConfig.load(config_file)
        except ConfigError as exc:  # a wrong key or value: running again would fail the same way
            fail(str(exc), run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV), env)
        self.process_group = process_group
        self._device_arg = device
        self._info = dict(info or {})
        self._env_arg = env
        self.step = 0
        self.restored_step: int | None = None
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.result: GuardResult | None = None
        self.done = False
        self._ended = False  # segment_end journaled (by a Run exit or the end of steps())
        self._started = False
        self._in_step: int | None = None
        self._total: int | None = None
        self._reported = False
        self._stop_agreed = False
        self._stop_seen: str | None = None  # what the ranks saw, when they agreed on report()
        self._signalled_at_end: str | None = None  # a preemption agreed in the last step: who saw it
        self._fields: dict[str, Any] = {}
        self._watchdog: StepWatchdog | None = None
        self._preemption: PreemptionHandler | None = None
        self._checkpoints: CheckpointManager | None = None
        self._forward_timer: ForwardTimer | None = None
        self._audit: ResumeAudit | None = None
        self._alloc_watch: AllocationWatch | None = None
        self._busy_steps = 0

    # ------------------------------------------------------------------ start / close

    def start(self) -> "Run":
        """Set everything up and resume from the newest valid checkpoint (collective)."""
        if self._started:
            raise RuntimeError("Run.start() called twice")
        self._phases = RestartPhases(_IMPORTED_AT)
        start_site = user_site(2)[:2]  # the user's `with Run(...)` line, named by resume warnings
        try:
            self.env = self._env_arg or JobEnv.from_environ()
        except JobEnvError as exc:
            fail(str(exc))
        if not self._run_dir_arg:
            fail(f"no run directory: pass Run(run_dir=...) or set ${RUN_DIR_ENV}")
        self.run_dir = RunDir(Path(self._run_dir_arg))
        try:
            check_run_dir_writable(self.run_dir)
        except RunDirError as exc:
            fail(str(exc))
        self.segment = Segment(self.env, self.run_dir)
        self._distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(self.process_group) if self._distributed else 1
        self.rank = dist.get_rank(self.process_group) if self._distributed else 0
        self.device = torch.device(self._device_arg) if self._device_arg else self._collective_device()
        self._started = True
        # Before the restore: its collectives may meet a dead peer.
        self._alloc_watch = watch_allocation(
            self.run_dir, self.env, self.process_group, self.world_size,
            on_reform=self._on_reform)
        if self._alloc_watch is not None:  # every rank journals the world's agreed attempt
            self.segment.journal.attempt = self._alloc_watch.attempt
        # Before the restore: the load announces itself in it, and its first beat says the run beats.
        self.heartbeat = Heartbeat(self.run_dir, self.env.node, job_id=self.env.job_id,
                                   restart_count=self.env.restart_count, attempt=self.segment.journal.attempt or 0,
                                   interval_s=self.config.heartbeat_interval_s,
                                   enabled=self.env.is_node_leader)
        self._checkpoints = CheckpointManager(
            self.run_dir.root, self.checkpoint_config, process_group=self.process_group,
            job_id=self.env.job_id, restart_count=self.env.restart_count, on_commit=self._on_commit,
            heartbeat=self.heartbeat)
        started = time.perf_counter()
        try:
            restored = self._checkpoints.load_latest(self.state)
        except CheckpointError as exc:  # another model, or a newer format: requeueing cannot help
            self._end(exitcodes.NO_REQUEUE, f"cannot resume: {exc}")
        load_s = time.perf_counter() - started
        self._phases.loaded(self._checkpoints.loaded_tier if restored is not None else None)
        self.restored_step = restored
        self.step = restored or 0
        self._audit = ResumeAudit(model=self.state.model, sampler=self.state.sampler, segment=self.segment,
                                  events=self.run_dir.events, log_every=self.config.log_every,
                                  rank0=self.env.is_rank0, restored_step=restored, world_size=self.world_size,
                                  trace=self.config.check_boundaries)
        self._audit.start_site = start_site
        self.segment.started(restored_step=restored, load_s=round(load_s, 6),
                             load_bytes=self._checkpoint_bytes(restored), carries=self.state.carried(),
                             **self._info)
        for skipped_step, reason in self._checkpoints.load_skipped:
            self.segment.record(journal.CHECKPOINT_SKIPPED, step=skipped_step, reason=reason)
        self.guard = StepGuard(self.guard_config)
        # Only the node leader writes the heartbeat, so only it times its forward pass.
        self._forward_timer = (ForwardTimer(self.state.model)
                               if self.config.time_forward and self.env.is_node_leader else None)
        self._busy_steps = 0
        if self.config.watchdog:
            self._watchdog = StepWatchdog(timeout_s=self.config.watchdog_timeout_s,
                                          on_fire=self._on_hang).start()
            self._checkpoints.watchdog = self._watchdog  # saves between steps are watched too
        self._preemption = PreemptionHandler(process_group=self.process_group, device=self.device,
                                             check_every=self.preemption_config.check_every,
                                             check_interval_s=self.preemption_config.check_interval_s
                                             ).install()
        self._boundary = BoundaryCheck(rank=self.rank, enabled=self.config.check_boundaries)
        self._boundary.mark()
        self._audit.trace_window()  # from here to the loop's first step: the lines that draw
        return self

    def close(self) -> None:
        """Stop the watchdog, restore the signal handlers, finish the save in flight. Idempotent."""
        if self._alloc_watch is not None:
            self._alloc_watch.stop()
            self._alloc_watch = None
        if self._forward_timer is not None:
            self._forward_timer.remove()
            self._forward_timer = None
        if self._audit is not None:
            self._audit.close()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
        if self._checkpoints is not None:
            self._checkpoints.close()

    def __enter__(self) -> "Run":
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._await_reform(exc)  # before close(): a save in flight may need a dead peer
        try:
            self.close()  # the save in flight commits before the segment's end is journaled
        finally:
            if isinstance(exc, SystemExit) and not self._ended and getattr(self, "segment", None) is not None:
                self._journal_script_exit(exc)

    # ------------------------------------------------------------------ the pieces

    @property
    def checkpoints(self) -> CheckpointManager:
        if self._checkpoints is None:
            raise RuntimeError("the Run has not started: use `with Run(...) as run:` or run.start()")
        return self._checkpoints

    @property
    def watchdog(self) -> StepWatchdog | None:
        return self._watchdog

    @property
    def preemption(self) -> PreemptionHandler | None:
        return self._preemption

    def rng(self, step: int | None = None, *, per_rank: bool = True,
            device: torch.device | str | None = None) -> torch.Generator:
        """A generator for ``step`` (default: the step in progress) seeded from (seed, step, rank).

        Batches drawn from it depend only on the step number (and rank, unless ``per_rank=False``:
        then every rank draws the same), so a resumed run draws exactly what an uninterrupted one
        did, with nothing to save. ``device``: where to draw (default: ``run.device``).
        """
        if step is None:
            if self._in_step is None:
                raise RuntimeError("Run.rng() without a step outside a step: pass the step")
            step = self._in_step
        return step_generator(self.config.seed, step, self.rank if per_rank else None,
                              device if device is not None else self.device)

    @contextlib.contextmanager
    def phase(self, label: str, bound_s: float) -> Iterator[None]:
        """Run a long phase of your own (an evaluation, data-loader start-up, an export) for at
        most ``bound_s`` seconds: the step watchdog gives it that bound instead of the step's
        (the step around it is paused), and this node's heartbeat announces it, so ``slurmft
        watch`` waits that long for the next beat instead of calling the run hung. Its time does
        not count as step time. Call it on every rank (only node leaders write the heartbeat).

            if step % 500 == 0:
                with run.phase("evaluation", bound_s=1800):
                    evaluate(model)
        """
        if not self._started:
            raise RuntimeError("the Run has not started: use `with Run(...) as run:` or run.start()")
        with contextlib.ExitStack() as stack:
            if self._watchdog is not None:
                stack.enter_context(self._watchdog.phase(label, bound_s))
            stack.enter_context(self.heartbeat.phase(label, bound_s))
            yield

    # ------------------------------------------------------------------ the loop

    def steps(self, total: int) -> Iterator[int]:
        """Yield steps ``self.step + 1 .. total`` (1-based); at its end save and write ``DONE``.

        Between steps it runs the boundary: guard verdicts, journal, heartbeat, periodic save,
        preemption (emergency save, exit 85; in the last step, the final save and ``DONE`` instead:
        a requeue would only start a segment to write it). Leaving the loop early (``break``) saves
        nothing.
        """
        if not self._started:
            raise RuntimeError("the Run has not started: use `with Run(...) as run:` or run.start()")
        if total < 0:
            raise ValueError(f"total steps must be >= 0, got {total}")
        self._total = total
        first = True
        while self.step < total:
            step = self.step + 1
            if first:
                assert self._audit is not None
                self._audit.loop_started(step)
                if not self._audit.checks_start:  # the exact check compares the restored state itself
                    file, line, _ = user_site(1)
                    site = self._audit.start_site
                    drawn, draw_site = self._audit.window_where("rng")
                    self._boundary.check(f"{drawn}between the start of the Run (its checkpoint restore, "
                                         f"{site[0]}:{site[1]}) and step {step} ({file}:{line})"
                                         if site else f"{drawn}between the start of the Run and step {step}",
                                         _ADVICE, draw_site, hold=True)  # settled at the step that draws
                first = False
            self._in_step, self._reported, self._fields, self.result = step, False, {}, None
            if self._audit is not None:
                self._audit.step_started(step, self._saves_at(step))
            if self._watchdog is not None:
                self._watchdog.step_started(step)
            try:
                yield step
            except GeneratorExit:  # the loop was left (break): stop watching the unfinished step
                if self._watchdog is not None:
                    self._watchdog.step_finished()
                self._in_step = None
                raise
            if self._watchdog is not None:
                self._watchdog.step_finished()
            self._in_step = None
            self._boundary_after(step, total)
        self._finish(total)

    def report(self, loss: Any, grad_norm: Any = None, **fields: Any) -> bool:
        """Judge this step: True when the optimizer may apply it. Call once per step, on every rank,
        after backward (and gradient clipping), before ``optimizer.step()``.

        ``loss``: this rank's loss (tensor or number); the guard and journal see the mean over ranks.
        ``grad_norm``: the global gradient norm (as ``clip_grad_norm_`` returns it; a DTensor is
        gathered); the mean over ranks is judged (equal ranks: itself). ``fields``: extra JSON fields
        for this step's ``loss`` event (rank 0's values).
        """
        if self._in_step is None:
            raise RuntimeError("Run.report() outside a step of run.steps()")
        if self._reported:
            raise RuntimeError(f"Run.report() called twice in step {self._in_step}")
        self._reported = True
        handler = self._preemption
        requested = handler is not None and handler.requested
        seen = handler.seen() if handler is not None else []
        values = self._values(loss, 0.0 if grad_norm is None else grad_norm, 1.0 if requested else 0.0,
                              *seen)
        if self._distributed and self.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.process_group)
        loss_sum, norm_sum, flags, *seen_sums = values.tolist()
        self.loss = loss_sum / self.world_size
        self.grad_norm = None if grad_norm is None else norm_sum / self.world_size
        self._stop_agreed = flags > 0
        # What the ranks saw, for the journal when this one saw nothing itself (not "peer").
        self._stop_seen = (None if handler is None or not self._stop_agreed else
                           "+".join(n for n, k in zip(handler.reasons, seen_sums) if k > 0) or None)
        self._fields = fields
        self.result = self.guard.check(self.loss, self.grad_norm or 0.0)
        if not self.result.ok and self.state.optimizer is not None:
            self.state.optimizer.zero_grad(set_to_none=True)
        return self.result.ok

    # ------------------------------------------------------------------ internals

    def _checkpoint_bytes(self, step: int | None) -> int:
        if step is None:
            return 0
        try:
            return read_manifest(self.run_dir.checkpoint(step)).total_bytes
        except (ManifestError, OSError):
            return 0

    def _collective_device(self) -> torch.device:
        """NCCL needs this rank's own GPU: the model's, else ``LOCAL_RANK``'s (a script that never
        called ``torch.cuda.set_device`` would otherwise put every rank on GPU 0)."""
        if self._distributed and "nccl" in str(dist.get_backend(self.process_group)):
            for param in self.state.model.parameters():
                if param.device.type == "cuda":
                    return param.device
            # srun --gpus-per-task / --gpu-bind shows each rank only its own GPU(s)
            return torch.device("cuda", self.env.local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    def _values(self, *values: Any) -> torch.Tensor:
        """One float64 vector on ``self.device``; on CPU built in one call (cheaper than a stack)."""
        values = tuple(v.full_tensor() if hasattr(v, "full_tensor") else v for v in values)  # DTensor
        if self.device.type == "cpu":
            return torch.tensor([float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
                                 for v in values], dtype=torch.float64)
        return torch.stack([v.detach().reshape(()).to(device=self.device, dtype=torch.float64)
                            if isinstance(v, torch.Tensor) else
                            torch.tensor(float(v), dtype=torch.float64, device=self.device)
                            for v in values])
