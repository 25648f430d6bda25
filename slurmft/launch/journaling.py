"""The launcher's voice: one log line format on stderr (the job log) and its journal events,
stamped with the array-aware job id, the raw ``SLURM_JOB_ID`` and the restart count. Journaling
is best effort: a journal that cannot be written is logged, never fatal to the decision."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from slurmft import journal
from slurmft.journal import JournalError
from slurmft.launch.identity import JobIdentity
from slurmft.rundir import RunDir


class Voice:
    def __init__(self, identity: JobIdentity | None, run_dir: Path | None = None) -> None:
        self.identity = identity
        self.run_dir = run_dir

    def log(self, message: str) -> None:
        who = self.identity.label if self.identity else "job ?"
        print(f"slurmft-launch[{who} {time.strftime('%H:%M:%S', time.gmtime())}]: {message}",
              file=sys.stderr, flush=True)

    def event(self, kind: str, /, **fields: Any) -> None:
        if self.run_dir is None or self.identity is None:
            return
        stamped = {"job_id": self.identity.slurm_id, "raw_job_id": self.identity.raw_job_id,
                   "restart_count": self.identity.restart_count, **fields}
        try:
            journal.append_event(RunDir(self.run_dir).events, kind, **stamped)
        except (JournalError, OSError) as exc:
            self.log(f"WARNING: could not append to the journal: {exc}")

    def template(self, action: str, **fields: Any) -> None:
        self.event(journal.TEMPLATE, action=action, **fields)
