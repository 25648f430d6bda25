"""The watcher's ETTR gauge, kept up to date from the journal's new lines only.

``slurmft status`` computes a run's effective training time ratio from its whole journal
(``status.build_report``); the watcher refreshes the gauge every few minutes for every run it
watches, so reading every whole journal each time would cost the shared filesystem a run's full
history per refresh. ``EttrTail`` reads only the bytes appended since its last refresh and
accumulates what that ratio is made of, with the same rules as ``build_report``: a loss row's
time is the gap to the previous row of its segment (the segment's median gap for its first row);
a row whose step is logged again later (redone after a restore) is not productive; the wall
clock runs from the run's submission (``watch_started``'s ``job_submit_time``) or first segment
start to its finish or now. Segments are keyed as ``slurmft status`` keys them
(``status/segkeys.py``): a restart of the world inside the allocation is a segment of its own, so
the time it took is lost time, not the duration of the next step.

Memory stays bounded over months: per-step times are kept only for steps above the oldest of
the last ``FROZEN_COMMITS`` committed checkpoints (no restore goes further back), the rows below
are summed; a segment's median gap is taken over its first ``MAX_GAPS`` gaps.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from slurmft import exitcodes, journal
from slurmft.journal import Event
from slurmft.status.segkeys import Key, SegmentKeys
from slurmft.watch.follow import JournalFollower

FROZEN_COMMITS = 32
MAX_GAPS = 8192
MAX_SUBMITS = 256


@dataclass
class _Rows:
    """One segment's loss rows so far: the last one's time and the gaps between them."""

    last_time: float | None = None
    gaps: list[float] = field(default_factory=list)

    def median(self) -> float:
        return statistics.median(self.gaps) if self.gaps else 0.0


@dataclass
class _Segment:
    start: float
    end: float | None = None
    exit_code: int | None = None


class EttrAccumulator:
    """Fed the journal's events in file order (``add``); ``ettr(now)`` at any time."""

    def __init__(self) -> None:
        self.keys = SegmentKeys()  # a restart in the allocation is a segment of its own
        self.segments: dict[Key, _Segment] = {}
        self.last_segment: Key | None = None   # the one with the latest start
        self.rows: dict[Key, _Rows] = {}
        self.live: dict[int, tuple[Key, float | None]] = {}  # step -> (segment, time; None: median)
        self.frozen_s = 0.0
        self.frozen_firsts: dict[Key, int] = {}  # first rows (median time) summed into frozen
        self.commits: deque[int] = deque(maxlen=FROZEN_COMMITS)
        self.submits: deque[float] = deque(maxlen=MAX_SUBMITS)
        self.finished_at: float | None = None

    def add(self, event: Event) -> None:
        kind = event.kind
        key = self.keys.key(event)  # every event, in file order: the keys follow the segments
        if kind == journal.LOSS:
            step = event.count("step")
            if step is not None and key is not None:
                self._row(step, event.time, key)
        elif kind == journal.CHECKPOINT_COMMITTED:
            step = event.count("step")
            if step is not None:
                self.commits.append(step)
                if len(self.commits) == self.commits.maxlen:
                    self._freeze(min(self.commits))
        elif kind == journal.RUN_FINISHED:
            self.finished_at = event.time
        elif kind == journal.WATCH_STARTED:
            submitted = event.when("job_submit_time")
            if submitted is not None:
                self.submits.append(submitted)
        elif kind in (journal.SEGMENT_START, journal.SEGMENT_END):
            if key is None:
                return
            if kind == journal.SEGMENT_START and key not in self.segments:
                self.segments[key] = _Segment(event.time)
                latest = self.segments.get(self.last_segment) if self.last_segment else None
                if latest is None or event.time >= latest.start:
                    self.last_segment = key
            elif kind == journal.SEGMENT_END and key in self.segments:
                seg = self.segments[key]
                seg.end, seg.exit_code = event.time, event.integer("exit_code")

    def _row(self, step: int, when: float, key: Key) -> None:
        rows = self.rows.setdefault(key, _Rows())
        duration = None
        if rows.last_time is not None:
            duration = max(when - rows.last_time, 0.0)
            if len(rows.gaps) < MAX_GAPS:
                rows.gaps.append(duration)
        rows.last_time = when
        self.live[step] = (key, duration)  # a step logged again: its earlier row was redone

    def _freeze(self, floor: int) -> None:
        for step in [s for s in self.live if s <= floor]:
            key, duration = self.live.pop(step)
            if duration is None:
                self.frozen_firsts[key] = self.frozen_firsts.get(key, 0) + 1
            else:
                self.frozen_s += duration

    def ettr(self, now: float) -> float | None:
        if not self.segments:
            return None
        medians = {key: rows.median() for key, rows in self.rows.items()}
        productive = self.frozen_s + sum(medians.get(k, 0.0) * n for k, n in self.frozen_firsts.items())
        productive += sum(medians.get(k, 0.0) if d is None else d for k, d in self.live.values())
        first = min(seg.start for seg in self.segments.values())
        first = min([first] + [t for t in self.submits if 0 < t <= first])
        last = self.segments[self.last_segment] if self.last_segment else None
        if self.finished_at is not None:
            end = self.finished_at
        elif last is not None and last.exit_code == exitcodes.OK and last.end is not None:
            end = last.end
        else:
            end = now
        wall = max(end - first, 0.0)
        # A fraction: steps can add up to more than the wall only in a journal whose times go
        # backwards (clocks of nodes apart, or a hand-made one; the fuzz test's journals).
        return min(productive / wall, 1.0) if wall > 0 else None


class EttrTail(JournalFollower):
    """An ``EttrAccumulator`` fed from ``path``'s lines appended since the last ``poll``; a
    journal replaced or truncated is read again from its start."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.acc = EttrAccumulator()

    def poll(self) -> EttrAccumulator:
        self._follow()
        return self.acc

    def _restart(self) -> None:
        self.acc = EttrAccumulator()

    def _event(self, event: Event, raw: bytes) -> None:
        self.acc.add(event)
