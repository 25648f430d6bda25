"""In-allocation mode's process faults: a rank that crashed or hung on a healthy node.

torchrun restarts the workers of every node in place by itself (a failed worker restarts its
agent's group, which puts it on the rendezvous' wait list, which restarts every other agent's):
the launcher fences nothing then, but it journals what happened, the same way as a requeue's
fault, and bounds it by progress. It follows the run's journal (``watch.follow``: only the
appended bytes, untrusted, bounded) for this job segment (job id, restart count):

  ``hang`` (the step watchdog fired)              -> ``fault_detected`` cause ``hang`` at once
  ``rank_exit`` (a crash its node's warm server    -> ``fault_detected`` cause ``rank_crash`` once
  saw, ``rankexit``)                                  the node beat ``BEAT_AFTER_S`` after it was
                                                      read (none from a node that died: its fence's)
  a ``segment_start`` after the first one that no  -> ``fault_detected`` cause ``rank_crash``
  fence and no re-form (``segment_end`` 88) explains  (unless a hang explained it), and
                                                      ``recovery_action`` ``restart_in_place``

``SLURMFT_ALLOC_RESTARTS`` (3) in-place restarts in a row without a newer committed checkpoint
end the job with 86 (a crash loop: running again would fail the same way).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slurmft import exitcodes, journal
from slurmft.journal import Event
from slurmft.watch.follow import JournalFollower


# What the ranks record when the run ends by intent (done, preempted and saved, do not requeue):
# torchrun, whose restarts are left to the launcher, would start them again.
ENDS = (exitcodes.OK, exitcodes.REQUEUE, exitcodes.NO_REQUEUE)
# A crash's node must beat again at least this long after its ``rank_exit`` was read (a node's
# task beats every second): a node killed whole may have had its ranks reaped a moment before it
# died. Without such a beat within SETTLE_S the crash is dropped (the node's fence is the fault).
BEAT_AFTER_S = 0.5
SETTLE_S = 5.0


@dataclass
class InPlace:
    """A restart in place the launcher learned of: what it journals."""

    cause: str                       # rank_crash | hang
    nodes: list[str]
    evidence: list[str]
    fault_time: float
    detected: bool = False           # the fault_detected was journaled already (a hang's)


@dataclass
class _Seen:
    starts: int = 0
    last_loss_t: float | None = None
    newest_commit: int | None = None
    reformed: bool = False           # a segment_end 88 since the last start
    ended: int | None = None         # the ranks recorded an end (0, 85, 86): no restart may follow
    hang: InPlace | None = None
    crash: InPlace | None = None     # this segment's first rank_exit (pending until journaled)
    crash_read: float = 0.0          # monotonic: when it was read
    found: list[InPlace] = field(default_factory=list)   # faults seen, in order
    restarts: list[InPlace] = field(default_factory=list)  # restarts in place, in order


class ProcessFaults(JournalFollower):
    def __init__(self, events: Path, job_ids: set[str], restart_count: int,
                 beat_within: Callable[[str, float], bool] = lambda node, s: False) -> None:
        super().__init__(events)
        self.job_ids, self.restart_count, self.beat_within = job_ids, restart_count, beat_within
        try:  # what was journaled before this launch is no segment of it: read from here on
            info = os.lstat(events)
            self.identity, self.offset = (info.st_dev, info.st_ino), info.st_size
        except OSError:
            pass
        self.seen = _Seen()
        self.fences = 0          # fences since the last segment start (``fenced``)
        self.commit_at_restart: int | None = None
        self.without_progress = 0

    def _restart(self) -> None:
        self.seen = _Seen()

    def _event(self, event: Event, raw: bytes) -> None:
        if str(event.get("job_id")) not in self.job_ids or event.count("restart_count") != self.restart_count:
            return
        seen = self.seen
        if event.kind == journal.LOSS:
            seen.last_loss_t = event.time
        elif event.kind == journal.CHECKPOINT_COMMITTED:
            step = event.count("step")
            if step is not None and (seen.newest_commit is None or step > seen.newest_commit):
                seen.newest_commit = step
        elif event.kind == journal.SEGMENT_END and event.integer("exit_code") == exitcodes.REFORM:
            seen.reformed = True
        elif event.kind == journal.SEGMENT_END and event.integer("exit_code") in ENDS:
            seen.ended = event.integer("exit_code")
        elif event.kind == journal.HANG and seen.hang is None:
            node = event.text("node")
            why = event.text("reason") or event.text("message") or "the step watchdog fired"
            seen.hang = InPlace("hang", [node] if node else [],
                                [f"rank {event.get('rank')}: {why}"],
                                seen.last_loss_t if seen.last_loss_t is not None else event.time, True)
            seen.found.append(seen.hang)
        elif event.kind == journal.RANK_EXIT and seen.crash is None and seen.hang is None \
                and not seen.reformed and self.fences == 0:
            node, rank = event.text("node"), event.get("rank")
            seen.crash = InPlace("rank_crash", [node] if node else [], [
                f"rank {rank} on {node or 'a node'} ended: {event.text('how') or event.get('exit_code')} "
                "(seen by its node's warm server)"], event.time)
            seen.crash_read = time.monotonic()
        elif event.kind == journal.SEGMENT_START:
            seen.starts += 1
            if seen.starts > 1 and not seen.reformed and self.fences == 0:
                fault = seen.hang or seen.crash or InPlace(
                    "rank_crash", [], ["the ranks started again without a fence or a re-form by "
                                       f"the launcher (torchrun attempt {event.get('attempt')})"],
                    seen.last_loss_t if seen.last_loss_t is not None else event.time)
                if not fault.detected:
                    fault.detected = True
                    seen.found.append(fault)
                seen.restarts.append(fault)
            seen.reformed, seen.hang, seen.crash, self.fences = False, None, None, 0

    @property
    def newest_commit(self) -> int | None:
        """The newest checkpoint step this segment's ranks journaled as committed, the journal
        read up to now first: an admin's drain is judged against the newest checkpoint at its first
        sight (``nodestate``), and a reading one loop old took a commit just before the drain for
        one after it (the node fenced at once, the steps since that commit lost)."""
        self._follow()
        return self.seen.newest_commit

    @property
    def ended(self) -> int | None:
        """The end the ranks recorded (0 / 85 / 86), None while they train."""
        return self.seen.ended

    def fenced(self) -> None:
        """The launcher fenced an active node: the next world's start is that fence's restart.
        What was journaled before the fence is read first (it belongs to the world before)."""
        self._follow()
        self.fences += 1

    def poll(self) -> tuple[list[InPlace], list[InPlace]]:
        """(faults to journal as detected, restarts in place to journal), each once."""
        self._follow()
        crash, age = self.seen.crash, time.monotonic() - self.seen.crash_read
        if crash is not None and not crash.detected:
            if self.fences or self.seen.reformed:   # the launcher's fence or re-form explains it
                self.seen.crash = None
            elif age > BEAT_AFTER_S and all(self.beat_within(n, age - BEAT_AFTER_S) for n in crash.nodes):
                crash.detected = True
                self.seen.found.append(crash)
            elif age > SETTLE_S:   # no beat since: its node died with it (its fence tells)
                self.seen.crash = None
        found, restarts = self.seen.found, self.seen.restarts
        self.seen.found, self.seen.restarts = [], []
        return found, restarts

    def count_restart(self) -> int:
        """One more restart in place; how many in a row had no newer committed checkpoint."""
        newest = self.seen.newest_commit
        progressed = newest is not None and (self.commit_at_restart is None
                                             or newest > self.commit_at_restart)
        self.without_progress = 1 if progressed else self.without_progress + 1
        self.commit_at_restart = newest
        return self.without_progress
