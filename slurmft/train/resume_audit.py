"""``Run``'s side of the resume check: when to fingerprint, what to compare, how to report.

Rank 0 fingerprints (:mod:`slurmft.train.fingerprint`) the first step of every segment, every
step that is saved, every ``log_every``-th step, and after a resume every step the interrupted run
journaled. The fingerprint rides on the step's ``loss`` event (``fp``). After a resume, the exact
check (:mod:`slurmft.train.resume_check`) and the redone-loss check (:mod:`slurmft.train.redo_check`,
for what no fingerprint sees: state the checkpoint does not carry) compare; the first divergence
is journaled as ``resume_diverged`` (step, cause, message, and ``site``: the user's line) and
warned once with a :class:`ResumeDivergenceWarning` attributed to that line.

The line comes from the draw tracer (:mod:`slurmft.train.rng_trace`): it follows the window
between the restore and the loop at every start (a draw there is the "batch drawn before the loop"
trap, named at once), and, when a divergence was found at the end of a step, the step after it
(the line that prefetches the next batch after the forward pass shows there). So the report of a
divergence found by a step comes one step later; a segment that ends first reports it unnamed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from slurmft import journal
from slurmft.train.boundary import changed_generators, rng_fingerprint, user_site, warn_user
from slurmft.train.fingerprint import InputDigest, rng_digest, state_digest
from slurmft.train.redo_check import RedoneLosses
from slurmft.train.resume_check import FP_VERSION, Divergence, ResumeCheck
from slurmft.train.rng_trace import Draw, DrawTracer

_SHOWN = 3  # draws named in one message


def _described(draws: list[Draw]) -> str:
    text = "; ".join(d.describe() for d in draws[:_SHOWN])
    return text + (f" (and {len(draws) - _SHOWN} more)" if len(draws) > _SHOWN else "")


def _trace_note(tracer: DrawTracer | None, what: str) -> str:
    if tracer is None or not tracer.available:
        return f" ({what} was not traced: another tracer, a debugger or coverage, is installed)"
    if tracer.truncated:
        return f" (the trace of {what} stopped at its bound: the line may be after it)"
    return ""


def explain_step(found: Divergence, step: int, draws: list[Draw]) -> tuple[str, Draw | None]:
    """What the trace of ``step`` (the one after the divergence) says about ``found``: the text
    added to its message and the draw to attribute the warning to."""
    outside = [d for d in draws if d.moved]
    if found.cause in ("inputs", "stale_inputs"):
        # A draw after the forward pass is the classic prefetch; one before it, with the inputs
        # still not the step's own, is a batch drawn for a later step all the same.
        ordered = [d for d in outside if d.in_forward_step] + [d for d in outside if not d.in_forward_step]
        if ordered:
            return (f" In step {step} your loop draws at {_described(ordered)}, yet trains on a batch "
                    "drawn before the step: a batch drawn in one step and trained on in the next (a "
                    "prefetch) is held in a variable across the checkpoint boundary, so no checkpoint "
                    "holds it. Draw each step's batch inside the step, and train on that one.", ordered[0])
        return (f" In step {step} no line of yours drew from the global generators or the sampler outside "
                "the forward pass: the batch comes from state the checkpoint does not hold (an iterator "
                "over a DataLoader or dataset not given to Run: pass its sampler as Run(sampler=...)).", None)
    if found.cause == "sampler":
        moves = [d for d in outside if "sampler" in d.moved]
        if moves:
            return f" The sampler moves at {_described(moves)}.", moves[0]
    elif outside:
        return f" In step {step} your lines draw from the global generators at {_described(outside)}.", outside[0]
    return "", None


class ResumeAudit:
    """Fingerprints and resume checks of one segment (active on rank 0 when ``log_every`` > 0)."""

    def __init__(self, *, model: torch.nn.Module, sampler: Any, segment: Any, events: Any,
                 log_every: int, rank0: bool, restored_step: int | None, world_size: int,
                 trace: bool = True) -> None:
        self.enabled = rank0 and log_every > 0
        # The draw tracer names the user's lines (rank 0 warns): in the window before the loop for
        # the boundary check (``trace``) and the resume check, after a divergence for the latter.
        self.tracing = rank0 and (trace or self.enabled)
        self.log_every = log_every
        self.segment = segment
        self.model = model
        self.sampler = sampler
        self.restored_step = restored_step
        self.inputs = InputDigest(model) if self.enabled else None
        self.check: ResumeCheck | None = None
        self.redone: RedoneLosses | None = None
        self.diverged: Divergence | None = None
        self.pending: Divergence | None = None  # found; its line is traced in the next step
        self.start_site: tuple[str, int] | None = None
        self.window: DrawTracer | None = None
        self.window_draws: list[Draw] = []
        self._step_trace: tuple[int, DrawTracer, Callable[[], None]] | None = None
        self._extra: dict[str, Any] = {}
        # A start divergence (rng_before_loop) held until a step draws from a generator the window
        # moved: (it, its site, those generators' states at the loop's start, a step has ended).
        self._held_start: tuple[Divergence, tuple[str, int] | None, dict[str, Any], bool] | None = None
        self._first: int | None = None
        if self.enabled and restored_step is not None:
            self.check = ResumeCheck.from_journal(events, restored_step, world_size)
            self.redone = RedoneLosses.from_journal(events, restored_step)

    @property
    def checks_start(self) -> bool:
        """The exact check has the restored step's RNG fingerprint from the same world size (so the
        RNG heuristic is not needed). On another world size the restore reseeded the generators:
        a draw before the loop is then warned about as on a fresh start."""
        if self.check is None:
            return False
        saved = self.check.prints.get(self.check.restored_step)
        return saved is not None and saved.rng is not None and saved.world_size == self.check.world_size

    def _sampler_digest(self) -> str | None:
        if self.sampler is None or not hasattr(self.sampler, "state_dict"):
            return None
        return state_digest(self.sampler.state_dict())

    def trace_window(self) -> None:
        """Follow the user's lines from here (the end of the restore) to the loop's first step."""
        if self.tracing:
            self.window = DrawTracer(sampler=self.sampler).start(skip=2)

    def window_where(self, generators: str = "rng") -> tuple[str, tuple[str, int] | None]:
        """The window's draws (``rng``: of the global generators; ``sampler``: of the sampler) as
        ``"at <line> (...), "`` and the first one's site; ``("", None)`` when none was traced."""
        draws = [d for d in self.window_draws
                 if ("sampler" in d.moved) == (generators == "sampler") or len(d.moved) > 1]
        if not draws:
            note = _trace_note(self.window, "the start").strip()
            return (f"{note}, " if note else ""), None
        return f"at {_described(draws)}, ", (draws[0].file, draws[0].line)

    def loop_started(self, step: int) -> None:
        """At the first step of this segment (the loop's ``for`` has just asked for it)."""
        self._first = step
        if self.window is not None:
            self.window_draws = self.window.stop()
        if self.check is None:
            return
        file, line, _ = user_site(2)
        start = f"{self.start_site[0]}:{self.start_site[1]}" if self.start_site else "the restore"
        between = f"between {start} and {file}:{line}"
        (rng_at, rng_site), (smp_at, smp_site) = self.window_where("rng"), self.window_where("sampler")
        found = self.check.start(rng_digest(), self._sampler_digest(), rng_at + between, smp_at + between)
        if found is not None and found.cause == "rng_before_loop":
            # Decided at the first step that draws from the shifted stream: one the loop never draws
            # from (an evaluation before the loop; batches from run.rng(step), no dropout) leaves the
            # run bit for bit; one it draws from only at step 8 makes it differ from step 8 on.
            self._held_start = (found, rng_site, rng_fingerprint(self._window_generators() or None), False)
            self.check.done = False  # the other rules go on meanwhile
        elif found is not None:
            self._report(found, smp_site if found.cause == "sampler" else rng_site)

    def _window_generators(self) -> set[str]:
        return {name for d in self.window_draws for name in d.moved if name != "sampler"}

    def _settle_start(self, step: int) -> None:
        """At the end of each step while ``rng_before_loop`` is held: report it, naming this step,
        when this step drew from a generator the window moved (any, when the window was not
        traced). Their states stay the loop start's until a step draws, so one comparison of only
        those generators per step (a few microseconds for torch's) decides it."""
        if self._held_start is None:
            return
        found, site, before, _ = self._held_start
        if not changed_generators(before, rng_fingerprint(before.keys())):
            self._held_start = (found, site, before, True)
            return
        self._held_start = None
        if step != found.step:
            found = Divergence(step, found.cause, f"{found.message} Step {step} is the first step that "
                               "draws from that random state, so the resumed run differs from there on.")
        self._report(found, site)

    def drop_held(self) -> None:
        """Forget a held start divergence (a rollback restored the generators: the comparison is void)."""
        self._held_start = None

    def step_started(self, step: int, forced: bool) -> None:
        """Arm the input digest when this step will be fingerprinted; trace it when a divergence
        waits for its line."""
        if self.inputs is not None and self._wanted(step, forced):
            self.inputs.arm()
        if self.pending is not None and self._step_trace is None:
            tracer = DrawTracer(sampler=self.sampler)
            remove = tracer.forward_hooks(self.model)
            self._step_trace = (step, tracer.start(skip=2), remove)

    def _wanted(self, step: int, forced: bool) -> bool:
        if forced or step == self._first or step % self.log_every == 0:
            return True
        return self.check is not None and self.check.wants(step)

    def step_done(self, step: int, loss: float | None, world_size: int, forced: bool,
                  last: bool = False) -> dict[str, Any] | None:
        """The fingerprint for this step's ``loss`` event (None: no event for this step); compares.
        ``last``: no step follows in this segment (a divergence found now is reported now)."""
        if self._step_trace is not None:
            self._flush_pending()
        self._settle_start(step)
        if not self.enabled or not self._wanted(step, forced):
            return None
        # The RNG digest (numpy's state read dominates it) only where it is compared: saved steps
        # (the next start's state), each segment's first step, and steps after a resume.
        checking = self.check is not None and self.check.wants(step)
        rng = rng_digest() if forced or step == self._first or checking else None
        inputs = self.inputs.take() if self.inputs is not None else None
        sampler = self._sampler_digest()
        fp: dict[str, Any] = {"v": FP_VERSION, "rng": rng, "in": inputs, "smp": sampler}
        if step == self._first:
            fp["first"] = True
        if checking:
            assert self.check is not None
            self._found(self.check.after(step, rng, inputs, sampler), last)
        if self.redone is not None and self.diverged is None and self.pending is None:
            message = self.redone.check(step, loss, world_size)
            if message is not None:
                self._found(Divergence(step, "loss", message), last, loss=loss, journaled=self.redone.journaled)
        return fp

    def _found(self, found: Divergence | None, last: bool, **extra: Any) -> None:
        if found is None or self.diverged is not None or self.pending is not None:
            return
        if self.check is not None:
            self.check.done = True
        self.redone = None
        if last or not self.tracing:
            self._report(found, None, **extra)
        else:
            self.pending, self._extra = found, extra

    def flush(self) -> None:
        """At the segment's end: report the divergence waiting for its line, with what the trace of
        the step saw. A held start divergence whose first step never reached its end cannot be
        cleared: it is reported; one no step of the segment drew from is dropped (bit for bit)."""
        if self._held_start is not None:
            if not self._held_start[3]:
                self._report(*self._held_start[:2])
            self._held_start = None
        self._flush_pending()

    def _flush_pending(self) -> None:
        found, self.pending = self.pending, None
        traced: tuple[int, DrawTracer, Callable[[], None]] | None = self._step_trace
        self._step_trace = None
        if traced is not None:
            step, tracer, remove = traced
            remove()
            draws = tracer.stop()
        if found is None:
            return
        if traced is None:
            self._report(found, None, **self._extra)
            return
        text, draw = explain_step(found, step, draws)
        note = _trace_note(tracer, f"step {step}")
        found = Divergence(found.step, found.cause, found.message + text + note)
        self._report(found, None if draw is None else (draw.file, draw.line), **self._extra)

    def _report(self, found: Divergence, site: tuple[str, int] | None, **extra: Any) -> None:
        if self.diverged is not None:
            return
        self.diverged = found
        if self.check is not None:
            self.check.done = True
        self.redone = None
        warn_user(f"slurmft: WARNING: resume diverged at step {found.step}: {found.message}", site)
        if site is not None:
            extra["site"] = f"{site[0]}:{site[1]}"
        self.segment.record(journal.RESUME_DIVERGED, step=found.step, cause=found.cause,
                            message=found.message, **extra)

    def close(self) -> None:
        if self.window is not None:
            self.window.stop()
        self.flush()
        if self.inputs is not None:
            self.inputs.remove()
            self.inputs = None
