"""Which nodes still beat: the launcher's reading of ``<run_dir>/alive/<node>.json``, the file
each node's task (``slurmft.launch.task``) replaces every second.

Silence is measured on the launcher's own monotonic clock, from the last time it saw the file
change (its ``seq`` or ``pid``), never from the time written inside it: the node's clock may be
skewed, and a file from an earlier run must not count as a beat. A node that has not beaten yet
since its task was started is given ``startup_s`` (srun, python and the first write on a loaded
node) before it counts as silent. The file is untrusted: a beat is only a JSON object with an
integer ``seq``; the step id it names is used only when it is digits.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slurmft import safeio
from slurmft.rundir import RunDir

MAX_BYTES = 4096
_STEP_RE = re.compile(r"^[0-9]{1,10}$")


@dataclass
class _Seen:
    since: float                 # monotonic: when we started looking (the task's start)
    mark: tuple[int, int] | None  # (pid, seq) of the newest beat read
    changed: float | None         # monotonic: when the mark last changed
    step_id: str | None
    ended: int | None = None      # the exit status the task wrote in its last beat


def read_beat(path: Path) -> tuple[tuple[int, int], str | None, int | None] | None:
    """((pid, seq), step id, ended) of the beat at ``path``; None when there is no readable
    beat. ``ended``: the exit status of a task that ended by itself (its last beat)."""
    try:
        raw = json.loads(safeio.read_regular(path, MAX_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(raw, dict):
        return None
    seq, pid, step = raw.get("seq"), raw.get("pid"), raw.get("step_id")
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(pid, int) \
            or isinstance(pid, bool):
        return None
    ended = raw.get("ended")
    return ((pid, seq), step if isinstance(step, str) and _STEP_RE.fullmatch(step) else None,
            ended if isinstance(ended, int) and not isinstance(ended, bool) else None)


class Liveness:
    def __init__(self, run_dir: RunDir, *, startup_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = run_dir
        self.startup_s = startup_s
        self.clock = clock
        self._seen: dict[str, _Seen] = {}

    def expect(self, node: str) -> None:
        """Start watching ``node`` (its task was just started); a beat already there is old."""
        beat = read_beat(self.run_dir.alive(node))
        self._seen[node] = _Seen(self.clock(), beat[0] if beat else None, None, None)

    def forget(self, node: str) -> None:
        self._seen.pop(node, None)

    def poll(self) -> None:
        now = self.clock()
        for node, seen in self._seen.items():
            beat = read_beat(self.run_dir.alive(node))
            if beat is not None and beat[0] != seen.mark:
                seen.mark, seen.changed = beat[0], now
                seen.step_id = beat[1] or seen.step_id
                seen.ended = beat[2]

    def silent_s(self, node: str) -> float:
        """Seconds since ``node`` last beat (since it was expected, before its first beat)."""
        seen = self._seen[node]
        return self.clock() - (seen.changed if seen.changed is not None else seen.since)

    def silent(self, node: str, bound_s: float) -> bool:
        seen = self._seen[node]
        bound = bound_s if seen.changed is not None else max(bound_s, self.startup_s)
        return self.silent_s(node) > bound

    def has_beaten(self, node: str) -> bool:
        return self._seen[node].changed is not None

    def ended(self, node: str) -> int | None:
        """The exit status the node's task wrote as it ended by itself (None: it did not)."""
        return self._seen[node].ended

    def step_id(self, node: str) -> str | None:
        """The Slurm step id the node's task reported (digits), for fencing through Slurm."""
        seen = self._seen.get(node)
        return None if seen is None else seen.step_id
