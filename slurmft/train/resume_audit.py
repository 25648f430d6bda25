"""``Run``'s side of the resume check: when to fingerprint, what to compare, how to report.

Rank 0 fingerprints (:mod:`slurmft.train.fingerprint`) the first step of every segment, every
step that is saved, every ``log_every``-th step, and after a resume every step the interrupted run
journaled. The fingerprint rides on the step's ``loss`` event (``fp``). After a resume, the exact
check (:mod:`slurmft.train.resume_check`) and the redone-loss check (:mod:`slurmft.train.redo_check`,
for what no fingerprint sees: state the checkpoint does not carry) compare; the first divergence
is journaled as ``resume_diverged`` (step, cause, message) and warned once with a
:class:`ResumeDivergenceWarning` that points at the user's line (the training loop's ``for``).
"""

from __future__ import annotations

from typing import Any

import torch

from slurmft import journal
from slurmft.train.boundary import user_site, warn_user
from slurmft.train.fingerprint import InputDigest, rng_digest, state_digest
from slurmft.train.redo_check import RedoneLosses
from slurmft.train.resume_check import FP_VERSION, Divergence, ResumeCheck

class ResumeAudit:
    """Fingerprints and resume checks of one segment (active on rank 0 when ``log_every`` > 0)."""

    def __init__(self, *, model: torch.nn.Module, sampler: Any, segment: Any, events: Any,
                 log_every: int, rank0: bool, restored_step: int | None, world_size: int) -> None:
        self.enabled = rank0 and log_every > 0
        self.log_every = log_every
        self.segment = segment
        self.sampler = sampler
        self.restored_step = restored_step
        self.inputs = InputDigest(model) if self.enabled else None
        self.check: ResumeCheck | None = None
        self.redone: RedoneLosses | None = None
        self.diverged: Divergence | None = None
        self.start_site: tuple[str, int] | None = None
        self._first: int | None = None
        if self.enabled and restored_step is not None:
            self.check = ResumeCheck.from_journal(events, restored_step, world_size)
            self.redone = RedoneLosses.from_journal(events, restored_step)

    @property
    def checks_start(self) -> bool:
        """The exact check has the restored step's fingerprint (so the RNG heuristic is not needed)."""
        return self.check is not None and self.check.restored_step in self.check.prints

    def _sampler_digest(self) -> str | None:
        if self.sampler is None or not hasattr(self.sampler, "state_dict"):
            return None
        return state_digest(self.sampler.state_dict())

    def loop_started(self, step: int) -> None:
        """At the first step of this segment (the loop's ``for`` has just asked for it)."""
        self._first = step
        if self.check is None:
            return
        file, line, _ = user_site(2)
        start = f"{self.start_site[0]}:{self.start_site[1]}" if self.start_site else "the restore"
        where = f"between {start} and {file}:{line}"
        self._report(self.check.start(rng_digest(), self._sampler_digest(), where))

    def step_started(self, step: int, forced: bool) -> None:
        """Arm the input digest when this step will be fingerprinted."""
        if self.inputs is not None and self._wanted(step, forced):
            self.inputs.arm()

    def _wanted(self, step: int, forced: bool) -> bool:
        if forced or step == self._first or step % self.log_every == 0:
            return True
        return self.check is not None and self.check.wants(step)

    def step_done(self, step: int, loss: float | None, world_size: int, forced: bool) -> dict[str, Any] | None:
        """The fingerprint for this step's ``loss`` event (None: no event for this step); compares."""
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
            self._report(self.check.after(step, rng, inputs, sampler))
        if self.redone is not None and self.diverged is None:
            message = self.redone.check(step, loss, world_size)
            if message is not None:
                self._report(Divergence(step, "loss", message), loss=loss, journaled=self.redone.journaled)
        return fp

    def _report(self, found: Divergence | None, **extra: Any) -> None:
        if found is None or self.diverged is not None:
            return
        self.diverged = found
        if self.check is not None:
            self.check.done = True
        self.redone = None
        warn_user(f"slurmft: WARNING: resume diverged at step {found.step}: {found.message}")
        self.segment.record(journal.RESUME_DIVERGED, step=found.step, cause=found.cause,
                            message=found.message, **extra)

    def close(self) -> None:
        if self.inputs is not None:
            self.inputs.remove()
            self.inputs = None
