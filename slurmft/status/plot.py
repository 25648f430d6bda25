"""``slurmft status --plot FILE.png``: the run's timeline as a picture. matplotlib is an optional
extra (``pip install 'slurmft[plot]'``); without it ``write_plot`` raises ``PlotUnavailable``
with the one line to show.

Top: the step reached over time, one line per segment (a restart from an older checkpoint shows
as the line starting lower than where the last one ended), with each fault's downtime shaded
from the fault to training back at its restored step. Bottom: one bar per segment, coloured by
how it ended, with markers at each fault's detected / requeued / running times.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

from slurmft import exitcodes, journal
from slurmft.journal import Event
from slurmft.rundir import atomic_write_bytes
from slurmft.status.report import Report


# Segment bars by how the segment ended: done, saved and requeued, anything else is red.
_SEGMENT_COLOURS: dict[int | None, str] = {exitcodes.OK: "tab:green", exitcodes.REQUEUE: "tab:orange"}


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (or cannot draw)."""


_MARKERS = (("detected", "v", "tab:orange"), ("requeued", "s", "tab:purple"),
            ("running", "^", "tab:green"))


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib, which is not installed: "
                              "pip install 'slurmft[plot]'") from None
    matplotlib.use("Agg")  # a file, never a window (login nodes have no display)
    import matplotlib.pyplot as plt

    return plt


def write_plot(report: Report, events: Sequence[Event], path: Path) -> None:
    """Draw the timeline into ``path`` (PNG), written atomically (temp name, fsync, rename)."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    buf = io.BytesIO()
    try:
        _draw(top, bottom, report, events)
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=100)
    finally:
        plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())


def _draw(top, bottom, report: Report, events: Sequence[Event]) -> None:
    origin = report.first_time if report.first_time is not None else report.now
    span = report.wall_s  # to the run's end, or now for a run still going
    unit, scale = ("seconds", 1.0) if span < 600 else ("minutes", 60.0) if span < 36000 else ("hours", 3600.0)
    x = lambda t: (t - origin) / scale  # noqa: E731
    by_segment: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for e in events:
        step, job, restart = e.get("step"), e.get("job_id"), e.get("restart_count")
        if e.kind == journal.LOSS and isinstance(step, int) and isinstance(restart, int):
            by_segment.setdefault((str(job), restart), []).append((e.time, step))
    for i, seg in enumerate(report.segments):
        rows = by_segment.get((seg.job_id, seg.restart_count), [])
        if rows:
            top.plot([x(t) for t, _ in rows], [s for _, s in rows], lw=1.5,
                     label=f"segment {i} ({seg.job_id}.{seg.restart_count})")
        end = seg.end or seg.last_step_time or report.now
        colour = _SEGMENT_COLOURS.get(seg.exit_code, "tab:red")
        if seg.end is None and i == len(report.segments) - 1:
            colour = "tab:blue"  # still running (or killed and not yet seen as such)
        bottom.barh(0, x(end) - x(seg.start), left=x(seg.start), height=0.5,
                    color=colour, alpha=0.6)
    for f in report.faults:
        if f.fault_time is None:
            continue
        until = f.back or f.running or f.detected or f.fault_time
        top.axvspan(x(f.fault_time), x(until), color="tab:red", alpha=0.15)
        top.annotate(f.cause, (x(f.fault_time), top.get_ylim()[1]), fontsize=8,
                     rotation=90, va="top", ha="right")
        bottom.axvline(x(f.fault_time), color="tab:red", lw=1)
        for attr, marker, colour in _MARKERS:
            when = getattr(f, attr)
            if when is not None:
                bottom.plot([x(when)], [0], marker=marker, color=colour, ls="none",
                            label=attr if f is report.faults[0] else None)
    ettr = "-" if report.ettr is None else f"{report.ettr:.1%}"
    top.set_title(f"job {report.job_id}: {report.restarts} restarts, ETTR {ettr}")
    top.set_ylabel("step")
    if report.segments:
        top.legend(loc="lower right", fontsize=8)
    bottom.set_yticks([])
    bottom.set_xlabel(f"{unit} since the first segment started")
    if report.faults:
        bottom.legend(loc="upper left", fontsize=8, ncol=3)
