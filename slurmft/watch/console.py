"""What ``slurmft watch`` shows a person: one line per event of the watcher's (what it saw, what
it did, how long a recovery took) and, on a terminal, a live status line per watched run.

A ``RunWatch`` listener (``Console.on_event``) and a ``Watcher`` cycle hook (``after_cycle``).
On a TTY the lines print above a rich live display; elsewhere (a pipe, a log, systemd: stdout is
no TTY or ``JOURNAL_STREAM`` is set) the same lines are plain text, one per event, flushed at
once so the journal has them, and there is no live display. ``-q`` makes no Console at all.
"""

from __future__ import annotations

import os
import time
from typing import IO, Any, Callable, Mapping

import hostlist
from rich.console import Console as RichConsole
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from slurmft import journal, numbers


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``, ``3d04h``: compact, never a fraction."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _nodes(event: Mapping[str, Any]) -> str:
    names = [str(n) for n in event.get("nodes") or []]
    if not names:
        return ""
    try:
        return hostlist.collect_hostlist(names)
    except hostlist.BadHostlist:  # a name that is no host name (hostlist refuses it): as it is
        return ",".join(names)


def _on(event: Mapping[str, Any]) -> str:
    nodes = _nodes(event)
    return f" on {nodes}" if nodes else ""


def _num(value: Any) -> float | None:
    return numbers.unix_time(value)  # times only; what is no unix time is not shown


def describe(kind: str, event: Mapping[str, Any]) -> str | None:
    """One line for an event (None: an event kind a person need not see)."""
    job = f"job {event.get('job_id', '?')}"
    if event.get(journal.WHERE) == journal.WHERE_ALLOCATION:  # the launcher's, relayed
        job += " (in its allocation)"
    if kind == journal.WATCH_STARTED:
        return f"{job}: watching (run dir {event.get('run_dir', '?')})"
    if kind in (journal.FAULT_DETECTED, journal.PLANNED_END):
        what = "fault" if kind == journal.FAULT_DETECTED else "planned end"
        line = f"{job}: {what}: {event.get('cause')}{_on(event)}"
        return line + (f": {event['evidence']}" if event.get("evidence") else "")
    if kind in (journal.RECOVERY_ACTION, journal.RESTART_ACTION):
        action = str(event.get("action"))
        if event.get("ok") is False:
            return f"{job}: {action}{_on(event)} FAILED ({event.get('cause')}): {event.get('detail')}"
        return f"{job}: {action}{_on(event)} ({event.get('cause')})"
    if kind == journal.JOB_RUNNING:
        line = f"{job}: running again{_on(event)} after {event.get('cause')}"
        start, fault = _num(event.get("start_time")), _num(event.get("fault_time"))
        if start is not None and fault is not None:
            what = "restart" if event.get("planned") else "recovery"
            line += f"; {what} took {duration(start - fault)} (fault to start)"
        return line
    if kind == journal.JOB_RESUBMITTED:
        return f"{job}: Slurm had forgotten it: resubmitted as job {event.get('new_job_id')}"
    if kind == journal.WATCH_WARNING:
        detail = f": {event['detail']}" if event.get("detail") else ""
        return f"{job}: warning: {event.get('what')}{_on(event)}{detail}"
    if kind == journal.GAVE_UP:
        return (f"{job}: GAVE UP ({event.get('cause')}) after {event.get('restarts')} restart(s): "
                f"{event.get('reason')}; the job is held")
    if kind == journal.RUN_FINISHED:
        code = event.get("exit_code")
        return (f"{job}: finished: {event.get('how')}, {event.get('state')}"
                + (f", exit code {code}" if code is not None else ""))
    return None


def interactive(stream: IO[str], environ: Mapping[str, str] | None = None) -> bool:
    """A person's terminal: a TTY and not systemd's journal stream."""
    env = os.environ if environ is None else environ
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return tty and not env.get("JOURNAL_STREAM")


class Console:
    """Prints each event's line; with ``live``, keeps a status line per run under them."""

    def __init__(self, stream: IO[str], *, live: bool,
                 clock: Callable[[], float] = time.time) -> None:
        self.stream = stream
        self.clock = clock
        self._live: Live | None = None
        if live:
            self._rich = RichConsole(file=stream, highlight=False)
            self._live = Live(Text(""), console=self._rich, auto_refresh=False, transient=True)
            self._live.start()

    def on_event(self, kind: str, event: Mapping[str, Any]) -> None:
        line = describe(kind, event)
        if line is None:
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(_num(event.get("time")) or self.clock()))
        if self._live is not None:
            self._rich.print(f"[dim]{stamp}[/dim] {escape(line)}", soft_wrap=True)
        else:
            print(f"{stamp} {line}", file=self.stream, flush=True)

    def after_cycle(self, result) -> None:
        if self._live is None:
            return
        now = self.clock()
        lines = [status_line(run, now) for run in result.runs]
        self._live.update(Text("\n".join(lines) if lines else "no run watched yet", style="bold"),
                          refresh=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def status_line(run, now: float) -> str:
    """``job 7  watching  restarts 1  ckpt step 400 (2m10s ago)``."""
    st = run.state
    parts = [f"job {run.job_id}", st.phase]
    if st.recovery is not None:
        parts.append(f"recovering from {st.recovery.cause} for {duration(now - st.recovery.detect_time)}")
    parts.append(f"restarts {st.restarts}")
    commits = run.tail.summary.commits
    if commits:
        when, step, _ = commits[-1]
        parts.append(f"ckpt step {step} ({duration(now - when)} ago)")
    return "  ".join(parts)


def console_for(quiet: bool, stream: IO[str], environ: Mapping[str, str] | None = None) -> Console | None:
    """The Console ``slurmft watch`` uses: none with ``-q``; a live one on a person's terminal."""
    if quiet:
        return None
    return Console(stream, live=interactive(stream, environ))
