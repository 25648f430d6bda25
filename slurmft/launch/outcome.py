"""What a finished training step means, from the outcome THIS segment recorded in the journal
(``segment_end`` of this job id and restart count: torchrun reports any failed rank as exit 1),
else srun's exit status. A ``DONE`` file left by an earlier run is never consulted: a later run
in the same directory may train further.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from slurmft import exitcodes


class Next(enum.Enum):
    FINISHED = "finished"          # exit 0
    REQUEUE = "requeue"            # requeue (or ask the watcher to), exit 85
    NO_REQUEUE = "no_requeue"      # training said so deliberately: exit 86
    PASS_ON = "pass_on"            # a failure for slurmft watch: exit with its code


@dataclass(frozen=True)
class Decision:
    next: Next
    code: int
    why: str


def decide(recorded: int | None, srun_rc: int) -> Decision:
    if recorded is not None:
        if recorded == exitcodes.OK:
            return Decision(Next.FINISHED, exitcodes.OK, "training recorded a clean end")
        if recorded == exitcodes.REQUEUE:
            return Decision(Next.REQUEUE, exitcodes.REQUEUE, "training saved and asked to be requeued")
        if recorded == exitcodes.NO_REQUEUE:
            return Decision(Next.NO_REQUEUE, exitcodes.NO_REQUEUE,
                            "training asked not to be requeued (reason in the journal)")
        return Decision(Next.PASS_ON, recorded if 0 < recorded < 256 else 1,
                        f"training recorded {exitcodes.describe(recorded)}: leaving recovery to slurmft watch")
    if srun_rc == 0:
        return Decision(Next.FINISHED, exitcodes.OK, "the training step exited 0 without recording its end")
    code = srun_rc if 0 < srun_rc < 256 and srun_rc != exitcodes.NO_REQUEUE else 1
    return Decision(Next.PASS_ON, code, f"the training step failed (srun exit {srun_rc}) without "
                    "recording an outcome: leaving recovery to slurmft watch")
