"""``slurmft status JOBID|RUN_DIR``: what a run went through and where it stands, from its journal
(and Slurm): segments, faults with their times and lost work, ETTR, restarts by cause,
checkpoint loads, and what the watcher is waiting for.

A TARGET that names an existing directory or contains ``/`` is a run dir (Slurm is then asked,
best effort, about the job the journal names last); anything else must be a job id, whose run
dir comes from its job comment and must be owned by the job's user. Exit codes: 0 shown;
2 bad input (no such job, not a run dir, bad option); 4 Slurm could not be reached to look up
a JOBID.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from slurmft import numbers
from slurmft.config import ConfigError, load_section

EXIT_OK, EXIT_USAGE, EXIT_SLURM = 0, 2, 4


def _fail(code: int, message: str) -> typer.Exit:
    print(f"slurmft status: {message}", file=sys.stderr, flush=True)
    return typer.Exit(code)


def _looks_like_run_dir(target: str) -> bool:
    return "/" in target or Path(target).is_dir()


def _events_of(run_dir: Path):
    from slurmft.rundir import RunDir
    from slurmft.status.report import JournalUnreadable, read_journal

    events_path = RunDir(run_dir).events
    if not events_path.exists() and not events_path.is_symlink():
        raise _fail(EXIT_USAGE, f"{run_dir} is not a slurmft run dir (it has no {events_path.name})")
    try:
        return read_journal(events_path)
    except JournalUnreadable as exc:
        raise _fail(EXIT_USAGE, f"cannot read the run's journal: {exc}")


def _watch_state(run_dir: Path):
    """The watcher's saved state as JSON (None when there is none), or the StateError saying
    why it cannot be read (shown as unreadable)."""
    from slurmft.rundir import RunDir
    from slurmft.watch.state import StateError, read_saved

    try:
        return read_saved(RunDir(run_dir))
    except StateError as exc:
        return exc


def _allocation(run_dir: Path):
    """The in-allocation launcher's allocation.json (None when there is none), or the
    AllocationError saying why it cannot be read (shown as unreadable)."""
    from slurmft import allocation
    from slurmft.rundir import RunDir

    try:
        return allocation.read(RunDir(run_dir))
    except allocation.AllocationError as exc:
        return exc


def _lookup_job(client, job_id: str):
    """The job for a JOBID target, or a clear exit."""
    from slurmft.commands.joblookup import LookupFailed, find_job

    try:
        return find_job(client, job_id)
    except LookupFailed as exc:
        raise _fail(exc.code, str(exc))


def _best_effort_job(client, events):
    """(the Slurm job the journal names last, or None; a note when Slurm was not answered)."""
    from slurmft.slurm import validate
    from slurmft.slurm.client import SlurmError

    ids = [str(e.get("new_job_id") if e.kind == "job_resubmitted" else e.get("job_id"))
           for e in events if (e.kind == "segment_start" and e.get("job_id"))
           or (e.kind == "job_resubmitted" and e.get("new_job_id"))]
    if not ids:
        return None, ""
    try:
        return client.job(validate.job_id(ids[-1])), ""
    except SlurmError as exc:
        return None, f"Slurm could not tell about job {ids[-1]}: {str(exc).splitlines()[0][:120]}"


def status(
    target: str = typer.Argument(..., metavar="JOBID|RUN_DIR", help="A job id, or a run directory."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (for scripts)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw the timeline into this PNG "
                                        "(needs matplotlib: pip install 'slurmft\\[plot]')."),
    no_slurm: bool = typer.Option(False, "--no-slurm", help="With a RUN_DIR: do not ask Slurm."),
    config: Optional[Path] = typer.Option(None, "--config", help="slurmft.toml to read \\[slurm] from."),
) -> None:
    """Show a run's timeline, what each fault cost, its ETTR, and what it is waiting for.

    Per fault: fault -> detected -> requeued -> running -> back, and the steps it cost.
    """
    from slurmft.slurm.cli import CliSlurmClient
    from slurmft.slurm.config import SlurmConfig
    from slurmft.status.report import build_report, report_dict

    if plot is not None and plot.suffix.lower() != ".png":
        raise _fail(EXIT_USAGE, f"--plot {plot}: the file name must end in .png")
    if plot is not None and not plot.absolute().parent.is_dir():
        raise _fail(EXIT_USAGE, f"--plot {plot}: its directory does not exist")
    try:
        slurm_cfg = load_section(SlurmConfig, "slurm", config_file=config)
    except (ConfigError, ValueError) as exc:
        raise _fail(EXIT_USAGE, str(exc))
    note = ""
    if _looks_like_run_dir(target):
        run_dir = Path(target)
        if not run_dir.is_dir():
            raise _fail(EXIT_USAGE, f"run dir {run_dir} is not a directory")
        events = _events_of(run_dir)
        job = None
        if not no_slurm:
            quick = CliSlurmClient(dataclasses.replace(slurm_cfg, retries=0,
                                                       timeout=min(slurm_cfg.timeout, 10.0)))
            job, note = _best_effort_job(quick, events)
    else:
        from slurmft.slurm import validate
        from slurmft.slurm.client import InvalidArgument
        from slurmft.watch.resolve import ResolveError, run_dir_for

        try:
            job_id = validate.job_id(target)
        except InvalidArgument:
            raise _fail(EXIT_USAGE, f"{target!r} is neither a job id nor a run directory")
        job = _lookup_job(CliSlurmClient(slurm_cfg), job_id)
        try:
            run_dir = run_dir_for(job, None)
        except ResolveError as exc:
            raise _fail(EXIT_USAGE, f"{exc} (or give the run dir instead of the job id)")
        events = _events_of(run_dir)
    report = build_report(events, job, now=time.time(), watch_state=_watch_state(run_dir),
                          allocation=_allocation(run_dir))
    if plot is not None:
        from slurmft.status.plot import PlotUnavailable, write_plot

        try:
            write_plot(report, events, plot)
        except PlotUnavailable as exc:
            raise _fail(EXIT_USAGE, str(exc))
    if as_json:
        out = report_dict(report)
        out["run_dir"] = str(run_dir.resolve())
        out["note"] = note
        print(numbers.dumps(out, sort_keys=True))
    else:
        from slurmft.status.render import render

        render(report, run_dir, note)
        if plot is not None:
            print(f"timeline written to {plot}")


app = status
