"""The run's journal as the watcher follows it: ``JournalTail`` reads ``events.jsonl`` from a
byte offset (a cycle costs the new lines, not the whole history of a weeks-long run; a journal
that exists but cannot be read is "could not observe") and keeps ``JournalSummary`` up to date
line by line: segment starts and ends, commits, requeue requests, self-requeues, preemptions.
The reading itself (untrusted journal, bounded chunks, replaced or truncated journals) is
``follow.JournalFollower``'s.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from slurmft import exitcodes, journal
from slurmft.journal import Event, in_allocation
from slurmft.watch.follow import JournalFollower
_KEEP_COMMITS = 32
MAX_FENCED = 4096  # nodes taken from one fence event
# The launcher's actions that fence their nodes: a spare fenced, an active node replaced by a
# spare or dropped from a shrinking world (one event each, the fence implied).
FENCING = (journal.ALLOC_FENCE, journal.ALLOC_REPLACE, journal.ALLOC_SHRINK)
MAX_RELAYED = 256  # in-allocation events kept between two cycles for the listeners
MAX_KEPT_LINES = 4096  # journal lines a --once invocation hands to the next


@dataclass
class JournalSummary:
    """What the watcher needs from ``events.jsonl``, kept up to date line by line."""

    segment_starts: list[Event] = field(default_factory=list)
    segment_ends: dict[tuple[str, int], Event] = field(default_factory=dict)
    commits: deque = field(default_factory=lambda: deque(maxlen=_KEEP_COMMITS))
    requeue_requests: dict[tuple[str, int], Event] = field(default_factory=dict)
    self_requeues: dict[tuple[str, int], str] = field(default_factory=dict)  # -> the launcher's reason
    # -> the nodes the launcher excluded as it requeued itself (its template ``requeue`` event)
    self_requeue_excludes: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)
    preemptions: dict[tuple[str, int], Event] = field(default_factory=dict)  # the run saved on a signal
    gave_up: dict[tuple[str, int], str] = field(default_factory=dict)  # the launcher's exit 86: why
    last_loss_step: int | None = None
    last_loss_time: float | None = None
    events_read: int = 0
    # In-allocation mode (issue 27), per segment (job, restart count): the nodes the launcher
    # fenced (node -> its ``recovery_action`` fence event), and the time of the newest restart
    # inside the allocation (the launcher's newest event there, or the ranks' newest start of an
    # attempt > 0): what the watcher leaves alone, and from when a restarted world is judged.
    alloc_fenced: dict[tuple[str, int], dict[str, Event]] = field(default_factory=dict)
    alloc_faults: dict[tuple[str, int], dict[str, Event]] = field(default_factory=dict)  # the evidence
    alloc_restarted: dict[tuple[str, int], float] = field(default_factory=dict)
    # The launcher's in-allocation events as they arrive, and "running again" (the next segment
    # start after its fault), for the watcher's listeners (metrics, --on-event, the console):
    # (kind, fields), taken by ``take_relayed``; the fault each segment waits to run again after.
    relayed: list[tuple[str, float, dict]] = field(default_factory=list)
    alloc_waiting: dict[tuple[str, int], Event] = field(default_factory=dict)
    alloc_started: dict[tuple[str, int], float] = field(default_factory=dict)  # newest segment start

    @staticmethod
    def key(event: Event) -> tuple[str, int] | None:
        job, restart = event.get("job_id"), event.get("restart_count")
        if not isinstance(job, (str, int)) or isinstance(restart, bool) or not isinstance(restart, int):
            return None
        return str(job), restart

    def add(self, event: Event) -> None:
        self.events_read += 1
        key = self.key(event)
        kind = event.kind
        if kind == journal.LOSS:
            step = event.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                self.last_loss_step, self.last_loss_time = step, event.time
        elif kind == journal.CHECKPOINT_COMMITTED:
            step = event.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                self.commits.append((event.time, step, event.seconds("blocking_s")))
        elif key is None:
            return
        elif kind == journal.SEGMENT_START:
            self.segment_starts.append(event)
            del self.segment_starts[:-64]
            attempt = event.count("attempt")
            if attempt is not None and attempt > 0:
                self._restarted(key, event.time)
            self.alloc_started[key] = event.time
            fault = self.alloc_waiting.pop(key, None)
            if fault is not None:
                self._running(key, fault, event.time)
        elif kind in (journal.FAULT_DETECTED, journal.RECOVERY_ACTION) and in_allocation(event):
            self._restarted(key, event.time)
            if kind == journal.FAULT_DETECTED:
                faults = self.alloc_faults.setdefault(key, {})
                for node in event.names("nodes")[:MAX_FENCED]:
                    faults[node] = event
                self._relay(kind, event.time, key, {
                    "cause": event.text("cause", 200), "evidence": _said(event),
                    "nodes": event.names("nodes")[:MAX_FENCED],
                    "fault_time": event.when("fault_time"), "action": "in_allocation"})
                started = self.alloc_started.get(key)
                if started is not None and (event.when("fault_time") or event.time) < started:
                    self._running(key, event, started)  # a rank crash: said once the world restarted
                else:
                    self.alloc_waiting[key] = event
            else:
                waiting = self.alloc_waiting.get(key)
                spare, world = event.text("spare", 200), event.count("world_nodes")
                self._relay(kind, event.time, key, {
                    "action": event.text("action", 64), "nodes": event.names("nodes")[:MAX_FENCED],
                    "cause": event.text("cause", 200) or (waiting.text("cause", 200)
                                                          if waiting is not None else ""),
                    "ok": True, "detail": ", ".join(filter(None, (
                        f"spare {spare}" if spare else "", f"{world} nodes" if world else "")))})
                if event.get("action") == journal.ALLOC_FENCE:  # a spare: no world restarts
                    self.alloc_waiting.pop(key, None)
                if event.get("action") in FENCING:  # a replaced or dropped node is fenced too
                    fenced = self.alloc_fenced.setdefault(key, {})
                    for node in event.names("nodes")[:MAX_FENCED]:
                        fenced.setdefault(node, event)
        elif kind == journal.SEGMENT_END:
            self.segment_ends[key] = event
        elif kind == journal.REQUEUE_REQUEST:
            self.requeue_requests[key] = event
        elif kind == journal.TEMPLATE and event.get("action") == "requeue":
            self.self_requeues[key] = str(event.get("reason") or "")
            said = event.get("exclude")
            self.self_requeue_excludes[key] = tuple(
                n for n in (said.split(",") if isinstance(said, str) else ()) if n)[:MAX_FENCED]
        elif kind == journal.TEMPLATE and event.get("action") == "give_up":
            self.gave_up[key] = event.text("reason") or "the launcher gave up"
        elif kind == journal.PREEMPTION:
            self.preemptions[key] = event

    def _relay(self, kind: str, when: float, key: tuple[str, int], fields: dict) -> None:
        self.relayed.append((kind, when, {"job_id": key[0], "restart_count": key[1],
                                          journal.WHERE: journal.WHERE_ALLOCATION, **fields}))
        del self.relayed[:-MAX_RELAYED]

    def _running(self, key: tuple[str, int], fault: Event, start: float) -> None:
        self._relay(journal.JOB_RUNNING, start, key, {
            "nodes": [], "start_time": start, "cause": fault.text("cause", 200),
            "fault_time": fault.when("fault_time") or fault.time, "planned": False})

    def take_relayed(self) -> list[tuple[str, float, dict]]:
        """The in-allocation events read since the last call: (kind, time, fields)."""
        taken, self.relayed = self.relayed, []
        return taken

    def _restarted(self, key: tuple[str, int], when: float) -> None:
        self.alloc_restarted[key] = max(when, self.alloc_restarted.get(key, when))

    def fenced(self, ids, restart_count: int) -> dict[str, Event]:
        """The nodes the launcher fenced in segment (job, ``restart_count``), each with the
        launcher's fault event that named it (its evidence), else the fence event itself."""
        found: dict[str, Event] = {}
        for job_id in ([ids] if isinstance(ids, str) else sorted(ids)):
            key = (str(job_id), restart_count)
            faults = self.alloc_faults.get(key, {})
            for node, fence in self.alloc_fenced.get(key, {}).items():
                found[node] = faults.get(node, fence)
        return found

    def restarted_in_allocation(self, ids, restart_count: int) -> float | None:
        """When segment (job, ``restart_count``) last restarted inside its allocation (None:
        never; the launcher's fault and recovery events count from their time on)."""
        times = [self.alloc_restarted[(str(i), restart_count)]
                 for i in ([ids] if isinstance(ids, str) else ids)
                 if (str(i), restart_count) in self.alloc_restarted]
        return max(times) if times else None

    @staticmethod
    def find(mapping: dict, ids, restart_count: int):
        """``mapping[(id, restart)]`` for the first of the job's ``ids`` that has an entry (an
        array task's processes name it by its own number, Slurm by ``<array>_<task>``)."""
        for job_id in ([ids] if isinstance(ids, str) else sorted(ids)):
            value = mapping.get((str(job_id), restart_count))
            if value is not None:
                return value
        return None

    def outcome(self, ids, restart_count: int) -> int | None:
        """The exit code the segment (job, restart) recorded, if any."""
        event = self.find(self.segment_ends, ids, restart_count)
        code = None if event is None else event.get("exit_code")
        return code if isinstance(code, int) and not isinstance(code, bool) else None

    def no_requeue(self, ids, restart_count: int) -> bool:
        return self.outcome(ids, restart_count) == exitcodes.NO_REQUEUE

    def self_requeued(self, ids, restart_count: int) -> bool:
        ids = [ids] if isinstance(ids, str) else ids
        return any((str(i), restart_count) in self.self_requeues for i in ids)

    def newest_commit_step(self) -> int | None:
        return self.commits[-1][1] if self.commits else None

    def last_segment(self, job_id: str) -> Event | None:
        for event in reversed(self.segment_starts):
            if str(event.get("job_id")) == str(job_id):
                return event
        return None


def _said(event: Event) -> str:
    """The launcher's evidence (a list of lines, or one) as one printable line."""
    said = event.get("evidence")
    lines = said if isinstance(said, list) else [said] if said else []
    text = "; ".join(str(line)[:300] for line in lines[:8])
    return "".join(c if c.isprintable() else "?" for c in text)


class JournalTail(JournalFollower):
    """Follows one run's ``events.jsonl`` from a byte offset; lines are parsed as they arrive."""

    def __init__(self, path: Path, *, keep_lines: bool = False) -> None:
        """``keep_lines``: also keep the lines the summary is made of (every line but the
        losses, the newest of those, up to ``MAX_KEPT_LINES``) so that ``save`` can hand the
        place in the journal to the next ``--once`` invocation."""
        super().__init__(path)
        self.summary = JournalSummary()
        self._kept: deque[bytes] | None = deque(maxlen=MAX_KEPT_LINES) if keep_lines else None
        self._last_loss = b""

    def poll(self) -> JournalSummary:
        """The summary with the lines appended since the last poll; a journal whose identity
        and size have not changed costs one ``lstat``."""
        self._follow()
        return self.summary

    def _restart(self) -> None:
        self.summary = JournalSummary()
        if self._kept is not None:
            self._kept.clear()
        self._last_loss = b""

    def _event(self, event: Event, raw: bytes) -> None:
        self.summary.add(event)
        if self._kept is not None:
            if event.kind == journal.LOSS:
                self._last_loss = raw
            else:
                self._kept.append(raw)

    def kept_lines(self) -> list[bytes]:
        """With ``keep_lines``: the lines the summary is made of, in journal order (enough to
        rebuild it: ``restore``)."""
        return [*(self._kept or ()), *([self._last_loss] if self._last_loss else [])]

    def restore(self, identity: tuple[int, int], offset: int, lines: list[bytes]) -> None:
        """Carry on at ``offset`` of the journal ``identity`` (device, inode), the summary
        rebuilt from ``lines`` (``kept_lines`` of an earlier tail)."""
        self.summary, self._partial, self._last_loss = JournalSummary(), b"", b""
        if self._kept is not None:
            self._kept.clear()
        self._feed(b"".join(raw + b"\n" for raw in lines))
        self.summary.take_relayed()  # the last invocation's: told then
        self._partial = b""
        self.identity, self.offset = identity, offset

    @property
    def complete_offset(self) -> int:
        """The offset of the end of the last whole line read."""
        return self.offset - len(self._partial)
