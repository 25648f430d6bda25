"""The exact resume check: a resumed run's step fingerprints against the interrupted run's.

Every segment journals, on its ``loss`` events, a fingerprint of the state after the step and of
the step's inputs (``fp``: :mod:`slurmft.train.fingerprint`), always for its first step and for
every step it saves, and else every ``log_every``-th step. After a resume from checkpoint ``k``
rank 0 reads them once and compares, with no tolerance:

* at the start of step ``k+1``: the global RNG must be the state checkpoint ``k`` saved (same world
  size; another world size reseeds it) and the sampler's position the one step ``k`` ended with (any
  world size). A difference means something drew between the restore (``with Run(...)``) and the
  loop: a batch drawn before the loop, which the interrupted run had drawn from another state;
* each redone step (steps after ``k`` the interrupted run journaled, same world size): its inputs,
  then its RNG and sampler state after it. Differing inputs from identical starting state mean the
  batch came from outside the step: drawn before the loop or prefetched during the step before,
  and so in no checkpoint;
* the first step after the resume against the first steps of every earlier start: the same inputs
  (and, where journaled, different ones at the step after) mean the batch was drawn before
  ``with Run(...)``, where the restore never reaches it. This one needs no redone step, so it
  also works after a preemption, which redoes nothing.

Only the first divergence is reported (everything after it differs anyway). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmft import journal

_HEX = frozenset("0123456789abcdef")
FP_VERSION = 1  # of the digests in fingerprint.py: a change there must bump it


def _digest(value: Any) -> str | None:
    if isinstance(value, str) and len(value) == 16 and set(value) <= _HEX:
        return value
    return None


@dataclass(frozen=True)
class Print:
    """One journaled fingerprint: the state after ``step`` and that step's inputs."""

    step: int
    world_size: int | None
    rng: str | None
    inputs: str | None
    sampler: str | None
    first: bool  # the first step of its segment

    @classmethod
    def parse(cls, event: journal.Event) -> "Print | None":
        fp, step = event.get("fp"), event.count("step")
        if not isinstance(fp, dict) or step is None or fp.get("v") != FP_VERSION:
            return None  # another slurmft's digests (an upgrade mid-run) are not comparable
        world = event.count("world_size")
        return cls(step, world, _digest(fp.get("rng")), _digest(fp.get("in")), _digest(fp.get("smp")),
                   fp.get("first") is True)


@dataclass(frozen=True)
class Divergence:
    step: int
    cause: str      # rng_before_loop | sampler | stale_inputs | inputs | rng
    message: str


@dataclass
class ResumeCheck:
    """What earlier segments journaled; ``start()`` and ``after()`` compare the resumed run with it."""

    restored_step: int
    world_size: int
    prints: dict[int, Print] = field(default_factory=dict)   # step -> the latest journaled
    firsts: dict[str, int] = field(default_factory=dict)     # inputs digest -> a segment's first step
    done: bool = False
    _stale: tuple[int, int] | None = None  # (our first step, the earlier first step it repeated)

    @classmethod
    def from_journal(cls, events: Path, restored_step: int, world_size: int) -> "ResumeCheck":
        check = cls(restored_step, world_size)
        for event in journal.read_events(events, [journal.LOSS]):
            fp = Print.parse(event)
            if fp is None:
                continue
            check.prints[fp.step] = fp
            if fp.first and fp.inputs is not None and fp.world_size == world_size:
                check.firsts.setdefault(fp.inputs, fp.step)
        return check

    def wants(self, step: int) -> bool:
        """Still something to compare at ``step``: the steps the interrupted run journaled, and the
        two after the restore (the repeated-first-batch rule). After them the check is over, so a
        long segment pays nothing more for it."""
        last = max(self.prints, default=self.restored_step)
        return not self.done and step <= max(last, self.restored_step + 2)

    def _same_world(self, fp: Print) -> bool:
        return fp.world_size == self.world_size

    def start(self, rng: str, sampler: str | None, where: str, where_sampler: str | None = None) -> Divergence | None:
        """At the start of the first step after the resume (before it draws anything). ``where``,
        ``where_sampler``: the lines that moved the generators, the sampler (default ``where``)."""
        step = self.restored_step + 1
        saved = self.prints.get(self.restored_step)
        if self.done or saved is None:
            return None
        if self._same_world(saved) and saved.rng is not None and saved.rng != rng:
            return self._diverged(step, "rng_before_loop", (
                f"the global random state at the start of step {step} is not the one checkpoint "
                f"{self.restored_step} saved: something drew from it between the restore and the loop "
                f"({where}), e.g. a batch drawn before the loop, which the interrupted run drew from "
                "another state. Draw each step's batch inside the step (or from run.rng(step))."))
        if saved.sampler is not None and sampler is not None and saved.sampler != sampler:
            return self._diverged(step, "sampler", (
                f"the sampler's position at the start of step {step} is not the one step "
                f"{self.restored_step} ended with: something moved the sampler between the restore "
                f"and the loop ({where_sampler or where}). Take each step's batch from the sampler inside the step."))
        return None

    def after(self, step: int, rng: str | None, inputs: str | None, sampler: str | None) -> Divergence | None:
        """After ``step`` of the resumed run (``rng``, ``inputs``: None when not digested)."""
        if self.done:
            return None
        stale = self._stale_check(step, inputs)
        if stale is not None:
            return stale
        before = self.prints.get(step)
        if before is None or step <= self.restored_step:
            return None
        if self._same_world(before):
            if before.inputs is not None and inputs is not None and before.inputs != inputs:
                repeated = self.firsts.get(inputs)
                if repeated is not None and repeated != step:
                    return self._stale_divergence(step, repeated)
                return self._diverged(step, "inputs", (
                    f"step {step} was redone after the resume on other inputs than the interrupted run "
                    "gave it, from the same state: its batch came from outside the step (drawn before "
                    "the loop, or prefetched during the step before), so no checkpoint holds it. Draw "
                    "each step's batch inside the step, after the previous run.report()."))
            if before.rng is not None and rng is not None and before.rng != rng:
                return self._diverged(step, "rng", (
                    f"the global random state after redone step {step} differs from the interrupted "
                    "run's: the step drew from it differently (another number of draws, or a draw that "
                    "depends on state the checkpoint does not hold). Draw the same number of times in "
                    "each step: keep a draw whose count depends on state outside the checkpoint (a "
                    "counter, a clock, a file) out of the step, or carry that state in Run(extras=...)."))
        if before.sampler is not None and sampler is not None and before.sampler != sampler:
            return self._diverged(step, "sampler", (
                f"the sampler's position after redone step {step} differs from the interrupted "
                "run's: the sampler was advanced a different number of times. Take exactly one batch "
                "from the sampler per step, inside the step, and nothing from it between steps."))
        return None

    def _stale_check(self, step: int, inputs: str | None) -> Divergence | None:
        if self._stale is not None:  # the step after a repeated first batch: repeated too?
            ours, theirs = self._stale
            self._stale = None
            after = self.prints.get(theirs + 1)
            if step == ours + 1 and after is not None and after.inputs is not None and inputs is not None:
                if after.inputs == inputs:  # data that repeats (an epoch without shuffling): fine
                    return None
                return self._stale_divergence(ours, theirs)
            return None
        if step == self.restored_step + 1 and inputs is not None:
            repeated = self.firsts.get(inputs)
            if repeated is not None and repeated != step:
                if self.prints.get(repeated + 1) is None:
                    return self._stale_divergence(step, repeated)
                self._stale = (step, repeated)  # decided at the next step
        return None

    def _stale_divergence(self, step: int, repeated: int) -> Divergence:
        return self._diverged(step, "stale_inputs", (
            f"step {step}, the first after the resume, trained on the inputs step {repeated} had (the "
            "first step of an earlier start): its batch was drawn before `with Run(...)`, where the "
            "restore does not reach it, so it is the same batch at every start. Draw the first batch "
            "inside the loop (or after `with Run(...)` from run.rng(step))."))

    def _diverged(self, step: int, cause: str, message: str) -> Divergence:
        self.done = True
        return Divergence(step, cause, message)
