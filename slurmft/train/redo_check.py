"""After a resume, compare the first redone step's loss with what the journal says it was.

A restart redoes the steps between the restored checkpoint and the fault. With the step-boundary
rule kept, each redone step sees the same weights and the same batch, so its loss is the one the
journal recorded before (bit for bit on CPU, within rounding on a GPU). A loss that differs means
the resumed run drifted from the one that was interrupted, whatever the cause: a batch drawn from
the RNG before ``with Run(...)`` (which the restore then overwrote, so no RNG check can see it),
a data loader that does not resume, state that is not in the checkpoint. That is the one check
that catches them all; it warns loudly and journals the first mismatch (``resume_diverged``).

Torch-free: it reads the journal (rank 0 only, once, at the resume) and compares floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from slurmft import journal

# Only the FIRST redone step that was journaled is compared: a batch drawn before the Run, or a
# loader that does not resume, shows there already, while a GPU's non-deterministic reductions
# (~1e-7 relative per step, more in bf16) add up over later steps. Another batch moves a loss by
# percents.
RTOL = 1e-3


@dataclass
class RedoneLosses:
    """Losses journaled for steps after ``restored_step`` by earlier segments (step -> (loss, world))."""

    expected: dict[int, tuple[float, int | None]] = field(default_factory=dict)
    compared: bool = False  # the first comparable step was compared: nothing more to do
    diverged_at: int | None = None
    journaled: float | None = None  # the loss the interrupted run had at ``diverged_at``

    @classmethod
    def from_journal(cls, events: Path, restored_step: int) -> "RedoneLosses":
        expected: dict[int, tuple[float, int | None]] = {}
        for event in journal.read_events(events, [journal.LOSS]):
            step, loss, world = event.get("step"), event.get("loss"), event.get("world_size")
            if (isinstance(step, int) and not isinstance(step, bool) and step > restored_step
                    and isinstance(loss, (int, float)) and not isinstance(loss, bool)
                    and math.isfinite(loss)):
                expected[step] = (float(loss), world if isinstance(world, int) else None)
        return cls(expected)

    def check(self, step: int, loss: float | None, world_size: int) -> str | None:
        """A message the first time a redone step's loss differs from its journaled one."""
        before = self.expected.pop(step, None)
        if before is None or loss is None or self.compared:
            return None
        old, old_world = before
        if old_world is not None and old_world != world_size:
            return None  # another world size sums in another order: not comparable bit for bit
        self.compared = True
        if math.isclose(loss, old, rel_tol=RTOL, abs_tol=1e-12):
            return None
        self.diverged_at, self.journaled = step, old
        return (f"step {step} was redone after the resume with loss {loss!r}, but the interrupted run "
                f"journaled {old!r} for it: the resumed run is not the run that was interrupted. "
                "Typical causes: a batch drawn (or prefetched) before `with Run(...)`, a data loader "
                "or RNG that is not in the checkpoint. Draw each step's batch inside the step, and pass "
                "every stateful object the steps use to Run (sampler=..., extras=...).")
