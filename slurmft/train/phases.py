"""What a (re)start of the ranks cost, by phase, for the journal's ``restart_phases`` event.

Every restart pays the cold start again (a requeue, or torchrun's next attempt inside the
allocation), so where it goes is measured in the ranks themselves, on the wall clock, and rank 0
journals it when the segment's first step ends (``slurmft.journal.RESTART_PHASES``):

* ``process_start``: when this process started, from ``/proc/self/stat`` (its start time in
  clock ticks since boot, against ``CLOCK_BOOTTIME`` now: 10 ms resolution); None off Linux.
* ``torch_imported``: when ``slurmft.train.run`` finished its imports (torch, torch.distributed,
  slurmft's checkpoint engine). A script imports torch before it imports ``Run``, so this is
  when torch was ready, give or take the script's own imports; a warm worker forked from a
  server that had imported them (``slurmft.launch.warm``) had them at its start: ``process_start``.
* ``run_started``: ``Run.start()`` entered: the process group is up and the model built and
  wrapped (``init_process_group``, the model's construction and DDP's or FSDP's first
  broadcast lie between ``torch_imported`` and here).
* ``checkpoint_loaded``: the newest valid checkpoint restored (``tier``: ``local`` when it was
  read from the node-local tier, ``shared`` from the run dir, None on a fresh start).
* ``first_step_done``: the first step's boundary (its all-reduce done on every rank).

and the differences as ``import_s``, ``setup_s``, ``load_s``, ``first_step_s`` and ``total_s``
(process start to first step done). What happens before the process starts (the fault's
detection, torchrun's rendezvous) is the launcher's to journal; ``attempt`` (stamped on every
event) tells the attempts apart.
"""

from __future__ import annotations

import os
import time
from typing import Any

# A process start older than this, or in the future, is a misreading, not a measurement.
MAX_AGE_S = 366 * 86400.0


def process_start_time(stat_path: str = "/proc/self/stat") -> float | None:
    """This process's start as a unix time (10 ms resolution), or None where it cannot be read."""
    try:
        with open(stat_path, "rb") as f:
            text = f.read(4096).decode("ascii", errors="replace")
        # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
        fields = text[text.rindex(")") + 2:].split()
        start_ticks = int(fields[19])  # field 22, starttime
        ticks = os.sysconf("SC_CLK_TCK")
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / ticks
        now = time.time()
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    if not 0 <= age <= MAX_AGE_S:
        return None
    return now - age


class RestartPhases:
    """The marks of one segment's start (see the module docstring); ``event()`` once, at the end
    of the first step. ``torch_imported``: the wall time ``slurmft.train.run`` was imported."""

    def __init__(self, torch_imported: float) -> None:
        self.process_start = process_start_time()
        # Imported before this process started: a warm worker forked from a server that had
        # imported it (slurmft.launch.warm), whose imports were ready at the fork.
        self.torch_imported = torch_imported if self.process_start is None else \
            max(torch_imported, self.process_start)
        self.run_started = time.time()
        self.checkpoint_loaded: float | None = None
        self.tier: str | None = None
        self.reported = False

    def loaded(self, tier: str | None) -> None:
        self.checkpoint_loaded = time.time()
        self.tier = tier

    def event(self, **extra: Any) -> dict[str, Any] | None:
        """The ``restart_phases`` fields at the first step's end; None after the first call."""
        if self.reported:
            return None
        self.reported = True
        done = time.time()
        loaded = self.checkpoint_loaded if self.checkpoint_loaded is not None else self.run_started

        def span(start: float | None, end: float) -> float | None:
            return None if start is None else round(max(0.0, end - start), 6)

        return {"process_start": self.process_start, "torch_imported": self.torch_imported,
                "run_started": self.run_started, "checkpoint_loaded": loaded,
                "first_step_done": done, "tier": self.tier,
                "import_s": span(self.process_start, self.torch_imported),
                "setup_s": span(self.torch_imported, self.run_started),
                "load_s": span(self.run_started, loaded),
                "first_step_s": span(loaded, done),
                "total_s": span(self.process_start, done), **extra}
