"""Which segment each journal event belongs to, for ``slurmft status`` and the watcher's ETTR gauge.

A *segment* is one run of the training processes: a job's restart by Slurm (a requeue: its
restart count) or, in in-allocation mode (issue 27), a restart of the world inside the same
allocation (same job, same restart count). Rank 0 journals one ``segment_start`` per segment; the
ranks stamp ``attempt`` (torchrun's ``TORCHELASTIC_RESTART_COUNT``) on their events. The key of
a segment is (job id, restart count, ordinal): the ordinal counts the segment starts of that
(job id, restart count) in the journal's order, so that two segments never share a key even
where their ``attempt`` does (torchrun counts restarts per agent: a spare's agent joins at 0, and
a membership change restarts the workers without counting one). An event belongs to the newest
segment of its (job id, restart count) started before it in the file: the ranks of a world are
all stopped before the next world starts, so their buffered events are written first.

A second ``segment_start`` of a segment (a journal from every rank) starts no new segment: a
start is a new one when the current segment already journaled a loss or its end, or names
another ``attempt``.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurmft import journal
from slurmft.journal import Event

Key = tuple[str, int, int]


def job_key(event: Event) -> tuple[str, int] | None:
    """(job id, restart count) of an event that names both."""
    job, restart = event.get("job_id"), event.count("restart_count")
    if isinstance(job, bool) or not isinstance(job, (str, int)) or restart is None:
        return None
    return str(job), restart


@dataclass
class _Current:
    ordinal: int
    attempt: int | None
    used: bool = False  # a loss or the end was journaled in it


class SegmentKeys:
    """Feed it the journal's events in file order (``key``); it keeps one small record per
    (job id, restart count)."""

    def __init__(self) -> None:
        self._current: dict[tuple[str, int], _Current] = {}

    def key(self, event: Event) -> Key | None:
        """The segment ``event`` belongs to (None: it names no job and restart count)."""
        base = job_key(event)
        if base is None:
            return None
        current = self._current.get(base)
        attempt = event.count("attempt")
        if event.kind == journal.SEGMENT_START:
            if current is None:
                current = self._current[base] = _Current(0, attempt)
            elif current.used or (attempt is not None and current.attempt is not None
                                  and attempt != current.attempt):
                current = self._current[base] = _Current(current.ordinal + 1, attempt)
        elif current is None:
            return (*base, 0)
        elif event.kind in (journal.LOSS, journal.SEGMENT_END):
            current.used = True
        return (*base, current.ordinal)
