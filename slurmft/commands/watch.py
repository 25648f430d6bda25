"""``slurmft watch JOBID...``: the requeue daemon, run in the foreground by the job's owner.

Exit codes: 0 every watched run ended (finished, gave up, or was forgotten by Slurm) or, with
``--once``, the cycle ran; 2 bad input (nothing acted on); 3 another watcher holds a run;
4 Slurm could not be reached to start watching (or, with ``--once``, during the cycle).
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer

from slurmft.config import ConfigError, load_section

EXIT_OK, EXIT_USAGE, EXIT_LOCKED, EXIT_SLURM = 0, 2, 3, 4


def _fail(code: int, message: str) -> "typer.Exit":
    print(f"slurmft watch: {message}", file=sys.stderr, flush=True)
    return typer.Exit(code)


def watch(
    job_ids: List[str] = typer.Argument(..., metavar="JOBID...", help="Jobs to watch."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="The run dir (one job only); "
                                           "default: the job comment SLURMFT_RUN_DIR=..."),
    once: bool = typer.Option(False, "--once", help="One poll cycle, then exit (for cron)."),
    config: Optional[Path] = typer.Option(None, "--config", help="slurmft.toml to read \\[watch] from."),
    poll: Optional[float] = typer.Option(None, "--poll", help="Seconds between cycles (\\[watch] poll_s)."),
    hang_timeout: Optional[float] = typer.Option(None, "--hang-timeout",
                                                 help="Seconds of stale heartbeats that make a hang "
                                                      "(0: learned from the run)."),
    on_event: Optional[str] = typer.Option(None, "--on-event", help="Command run with each event as "
                                           "JSON on stdin (bounded time; its failure is logged)."),
    operator: bool = typer.Option(False, "--operator", help="Set a silent node of a watched job DOWN "
                                  "at once (needs Slurm operator rights) instead of waiting for "
                                  "SlurmdTimeout."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every event to stderr."),
    record: Optional[Path] = typer.Option(None, "--record", hidden=True,
                                          help="Append every observation to this JSONL file "
                                               "(detector test fixtures)."),
) -> None:
    """Watch jobs and bring every failed run back: requeue, exclude bad nodes, start now, hold."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="slurmft-watch %(asctime)s %(levelname)s %(message)s")
    from slurmft.rundir import RunDir
    from slurmft.slurm.client import JobNotFound, SlurmError, SlurmUnavailable
    from slurmft.slurm.config import SlurmConfig
    from slurmft.slurm import validate
    from slurmft.slurm.cli import CliSlurmClient
    from slurmft.watch.config import WatchConfig
    from slurmft.watch.loop import Watcher
    from slurmft.watch.resolve import ResolveError, check_owner, run_dir_for
    from slurmft.watch.runwatch import RunWatch
    from slurmft.watch.state import RunLock, StateError, load_state

    try:
        overrides = {"poll_s": poll, "hang_timeout_s": hang_timeout,
                     "operator": True if operator else None}
        cfg = load_section(WatchConfig, "watch", config_file=config,
                           overrides={k: v for k, v in overrides.items() if v is not None})
        client = CliSlurmClient(load_section(SlurmConfig, "slurm", config_file=config))
        ids = validate.job_ids(job_ids)
        hook = shlex.split(on_event) if on_event else None
    except (ConfigError, ValueError) as exc:
        raise _fail(EXIT_USAGE, str(exc))
    if len(set(ids)) != len(ids):
        raise _fail(EXIT_USAGE, "a job id is given twice")
    if run_dir is not None and len(ids) != 1:
        raise _fail(EXIT_USAGE, "--run-dir names the run dir of ONE job; give one JOBID with it")
    if on_event is not None and not hook:
        raise _fail(EXIT_USAGE, "--on-event is empty")

    listeners = []
    if hook:
        from slurmft.watch.notify import run_hook

        listeners.append(lambda kind, event: run_hook(hook, {"kind": kind, **event}, timeout_s=10.0))

    recorder = None
    if record is not None:
        from slurmft.watch.record import Recorder

        recorder = Recorder(record)
    runs, locks, seen_dirs = [], [], set()
    try:
        for job_id in ids:
            try:
                job = client.job(job_id)
            except JobNotFound:
                raise _fail(EXIT_USAGE, f"job {job_id} does not exist (neither the controller nor "
                            "accounting knows it)")
            except SlurmUnavailable as exc:
                raise _fail(EXIT_SLURM, f"cannot reach Slurm to look up job {job_id}: {exc}")
            except SlurmError as exc:
                raise _fail(EXIT_USAGE, f"job {job_id}: {exc}")
            try:
                check_owner(job)
                path = run_dir_for(job, run_dir)
            except ResolveError as exc:
                raise _fail(EXIT_USAGE, str(exc))
            if path in seen_dirs:
                raise _fail(EXIT_USAGE, f"two of the jobs write the same run dir {path}")
            seen_dirs.add(path)
            rd = RunDir(path)
            lock = RunLock(rd)
            try:
                lock.acquire()
                state = load_state(rd, job_id)
            except StateError as exc:
                raise _fail(EXIT_LOCKED if "already watched" in str(exc) else EXIT_USAGE, str(exc))
            locks.append(lock)
            if state.job_id != job_id:
                raise _fail(EXIT_USAGE, f"run dir {path} is watched for job {state.job_id}, not "
                            f"{job_id} (its watch/state.json says so)")
            runs.append(RunWatch(rd, state, client, cfg, listeners, recorder))
        watcher = Watcher(client, runs, poll_s=cfg.poll_s)
        try:
            if once:
                result = watcher.cycle()
                if not result.observed:
                    raise _fail(EXIT_SLURM, f"could not observe Slurm: {result.error}")
            else:
                watcher.run()
        except KeyboardInterrupt:
            print("slurmft watch: interrupted; state is saved, start it again to carry on",
                  file=sys.stderr)
        for run in runs:
            print(f"job {run.job_id}: {run.state.phase}"
                  + (f" ({run.state.reason})" if run.state.reason else ""))
    finally:
        for lock in locks:
            lock.release()


app = watch
