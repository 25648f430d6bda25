"""The terminal view of a ``slurmft.status.report.Report``: a few rich tables a person reads at a glance
(where the run stands first, then the numbers, then segments and faults). Times of day are UTC;
the steps of a fault are shown as seconds after the fault."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import hostlist
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from slurmft.status.report import PLANNED_CAUSES, Report


_ABS_PATH = re.compile(r"(?<![\w.~-])/(?:[^\s/:()\[\],;]+/)+[^\s/:()\[\],;]+")


def short_paths(text: str, run_dir: Path) -> str:
    """Paths in a journaled text as a person reads them at 80 columns: inside the run dir relative
    to it, any other absolute path of more than two parts as ``.../<dir>/<file>`` (a path wider
    than the terminal would be folded mid-word). ``--json`` keeps them whole."""
    for root in sorted({str(run_dir.absolute()), str(run_dir.resolve())}, key=len, reverse=True):
        text = text.replace(root.rstrip("/") + "/", "")

    def shorten(match: re.Match[str]) -> str:
        path = match.group(0)
        return path if path.count("/") <= 2 else ".../" + "/".join(path.rsplit("/", 2)[1:])

    return _ABS_PATH.sub(shorten, text)


def clock(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%S")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds == 0:
        return "0s"
    if abs(seconds) < 1:
        return f"{seconds * 1000:.0f}ms"
    if abs(seconds) < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def after(t: float | None, origin: float | None) -> str:
    if t is None or origin is None:
        return "-"
    return f"+{duration(t - origin)}" if t >= origin else f"-{duration(origin - t)}"


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"


def _summary(report: Report, run_dir: Path, note: str) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("run dir", escape(str(run_dir)))
    grid.add_row("job", str(report.job_id or "-"))
    grid.add_row("state", escape(report.state))
    grid.add_row("waiting for", escape(report.waiting_for))
    if report.watcher is not None:
        w = report.watcher
        saved = f"{w['phase']}, {w['restarts'] or 0} restarts" + (f": {w['reason']}" if w["reason"] else "")
        grid.add_row("watcher", escape(f"{saved} (its saved state; it may not be running now)"))
    if report.allocation is not None:
        grid.add_row("allocation", escape(_allocation(report)))
    if note:
        grid.add_row("note", escape(note))
    ettr = "-" if report.ettr is None else f"{report.ettr:.1%}"
    grid.add_row("ETTR", f"{ettr}  (productive {duration(report.productive_s)} of "
                         f"{duration(report.wall_s)} since the first start)")
    grid.add_row("steps", f"{report.steps_done if report.steps_done is not None else '-'} reached, "
                          f"{report.steps_redone} redone ({duration(report.redone_s)})")
    causes = ", ".join(f"{c} {n}" for c, n in report.restarts_by_cause.items()
                       if c not in PLANNED_CAUSES) or "no fault"
    planned = ", ".join(f"{c} {n}" for c, n in report.restarts_by_cause.items() if c in PLANNED_CAUSES)
    if planned:  # a time limit or a preemption is a planned end, not a fault
        causes += f"; planned: {planned}"
    grid.add_row("restarts", f"{report.restarts}  ({causes})")
    if report.checkpoints:
        age = None if report.last_checkpoint_time is None else report.now - report.last_checkpoint_time
        blocking = ("" if report.mean_checkpoint_blocking_s is None
                    else f", mean blocking {duration(report.mean_checkpoint_blocking_s)}")
        grid.add_row("checkpoints", f"{report.checkpoints} committed, newest step "
                                    f"{report.last_checkpoint_step} ({duration(age)} ago){blocking}")
    else:
        grid.add_row("checkpoints", "none committed")
    return grid


def _allocation(report: Report) -> str:
    """In-allocation mode: the launcher's nodes as allocation.json has them."""
    a = report.allocation or {}
    if "unreadable" in a:
        return f"allocation.json unreadable: {a['unreadable']}"
    fenced = ", ".join(f"{f['node']} ({f['cause'] or 'no cause'})" for f in a["fenced"][:8])
    whose = "" if a["job_id"] == report.job_id else f" (job {a['job_id']}'s)"
    fenced_nodes = {f["node"] for f in a["fenced"]}
    jobs = [j for j in a.get("spare_jobs") or [] if j["node"] not in fenced_nodes]
    outside = ", ".join(f"{j['job_id']} on {j['node']}" if j["node"] else f"{j['job_id']} queued"
                        for j in jobs[:8])
    return (f"generation {a['generation']}{whose}: active {nodes(a['active'])}, "
            f"spares {nodes(a['spares']) if a['spares'] else 'none'} ({len(a['spares'])}), "
            f"fenced {fenced or 'none'}" + (f"; at least {a['min_nodes']} nodes" if a["min_nodes"] else "")
            + (f"; spare jobs {outside}" if outside else ""))


def _table(title: str, headers: tuple[str, ...]) -> Table:
    """A table that fits 80 columns: one-word headers, no frame, two spaces between columns;
    a cell wraps only between words (a word is never folded while the table fits)."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0), show_edge=False)
    for name in headers:
        table.add_column(name)
    return table


def nodes(names) -> str:
    """A node list as Slurm writes it (``gpu[001-004]``): short at any size."""
    names = [str(n) for n in names]
    if not names:
        return "-"
    try:
        return hostlist.collect_hostlist(names)
    except hostlist.BadHostlist:  # a name from the run dir that is no host name: as it is
        return ",".join(names)


def _segments(report: Report) -> Table:
    table = _table("segments", ("#", "job.rst", "start", "ran", "nodes", "steps", "load", "ended"))
    for i, seg in enumerate(report.segments):
        end = seg.end if seg.end is not None else (seg.last_step_time if seg.last_step_time else None)
        steps = "-" if seg.first_step is None else f"{seg.first_step}-{seg.last_step}"
        if seg.restored_step is not None:
            steps += f" (from {seg.restored_step})"
        ranks = f" x{seg.world_size}" if seg.world_size else ""
        load = duration(seg.load_s) + ("" if seg.load_bandwidth is None
                                       else f" {size(seg.load_bandwidth)}/s")
        nxt = report.segments[i + 1] if i + 1 < len(report.segments) else None
        reformed = nxt is not None and (nxt.job_id, nxt.restart_count) == (seg.job_id, seg.restart_count)
        ended = seg.outcome or ("running" if nxt is None and seg.end is None
                                else "re-formed in the allocation" if reformed
                                else "killed (no end recorded)")
        table.add_row(str(i), f"{seg.job_id}.{seg.restart_count}"
                      + (f"/{seg.ordinal}" if seg.ordinal else ""), clock(seg.start),
                      duration(None if end is None else end - seg.start),
                      escape(seg.nodelist or "-") + ranks, steps, load, escape(ended))
    return table


def _faults(report: Report) -> Table:
    table = _table("faults (UTC; then times after the fault; steps and time lost; where: "
                   "requeue or in the allocation)",
                   ("#", "cause", "where", "at", "seen", "acted", "running", "back", "steps", "time"))
    for i, f in enumerate(report.faults):
        table.add_row(str(i), escape(f.cause), "alloc" if f.where == "allocation" else "requeue",
                      clock(f.fault_time), after(f.detected, f.fault_time),
                      after(f.requeued if f.acted is None else f.acted, f.fault_time),
                      after(f.running, f.fault_time),
                      after(f.back, f.fault_time), "-" if f.steps_lost is None else str(f.steps_lost),
                      duration(f.lost_s))
    return table


def _start_up(report: Report, console: Console) -> None:
    """Each restarted segment's start-up by phase (the ranks' ``restart_phases``), one line each,
    from the fault before it when there is one: where a recovery's seconds went."""
    before = {(f.job_id, f.restart_count, f.ordinal): f for f in report.faults}
    for i, seg in enumerate(report.segments):
        p = seg.restart_phases
        if p is None or i == 0:
            continue
        prev = report.segments[i - 1]
        fault = before.get((prev.job_id, prev.restart_count, prev.ordinal))
        lead = ""
        if fault is not None and fault.fault_time is not None and p["process_start"] is not None:
            lead = f"fault to process start {duration(p['process_start'] - fault.fault_time)}, "
        tier = f" ({p['tier']})" if p["tier"] else ""
        console.print(f"[bold]start-up[/] segment {i}: " + escape(
            f"{lead}import {duration(p['import_s'])}, setup {duration(p['setup_s'])}, "
            f"load {duration(p['load_s'])}{tier}, first step {duration(p['first_step_s'])}; "
            f"process to first step {duration(p['total_s'])}"))


def _evidence(report: Report, console: Console) -> None:
    """Each fault's nodes, steps and evidence on lines of their own, as wide as the terminal."""
    for i, f in enumerate(report.faults):
        lost = "" if f.steps_lost is None else f", steps {f.last_step}->{f.restored_step}"
        where = f" on {nodes(f.nodes)}" if f.nodes else ""
        console.print(f"[bold]#{i}[/] " + escape(f"{f.cause}{where}{lost}: {f.evidence or '-'}"))


def render(report: Report, run_dir: Path, note: str = "", console: Console | None = None) -> None:
    console = console or Console()
    console.print(_summary(report, run_dir, note))
    if report.segments:
        console.print(_segments(report))
    for i, seg in enumerate(report.segments):  # a damaged checkpoint the segment passed over
        for step, reason in seg.checkpoints_skipped:
            console.print(f"[yellow]checkpoint skipped[/] segment {i} ({escape(seg.job_id)}."
                          f"{seg.restart_count}): step {'-' if step is None else step} at load: "
                          + escape(short_paths(reason or "no reason recorded", run_dir)))
        if seg.resume_diverged is not None:  # the resumed run is not the one that was interrupted
            d = seg.resume_diverged
            site = f" at {short_paths(d['site'], run_dir)}" if d["site"] else ""
            console.print(f"[red]resume diverged[/] segment {i} ({escape(seg.job_id)}.{seg.restart_count}): "
                          + escape(f"step {'-' if d['step'] is None else d['step']} ({d['cause'] or 'no cause recorded'}){site}: "
                                   + short_paths(d["message"] or "no message recorded", run_dir)))
    _start_up(report, console)
    if report.faults:
        console.print(_faults(report))
        _evidence(report, console)
    for w in report.warnings:
        where = f" [{nodes(w['nodes'])}]" if w["nodes"] else ""
        console.print(f"[yellow]warning[/] {clock(w['time'])} "
                      + escape(f"{w['what']}{where}: {w['detail']}"))
