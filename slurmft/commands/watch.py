"""``slurmft watch JOBID...``: the requeue daemon, run in the foreground by the job's owner.

Exit codes: 0 every watched run ended (finished, gave up, or was forgotten by Slurm) or, with
``--once``, the cycle ran; 1 with ``--once``, a run's cycle failed (its files could not be used;
one line per run names it and why); 2 bad input (nothing acted on); 3 another watcher holds a
run; 4 Slurm could not be reached to start watching (or, with ``--once``, during the cycle).
"""

from __future__ import annotations

import copy
import faulthandler
import logging
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import typer

from slurmft.config import ConfigError, load_section

EXIT_OK, EXIT_CYCLE_FAILED, EXIT_USAGE, EXIT_LOCKED, EXIT_SLURM = 0, 1, 2, 3, 4
log = logging.getLogger("slurmft.watch")


class WatchStartError(Exception):
    """A job cannot be watched; ``code`` is the exit code, the message says why."""

    def __init__(self, code: int, message: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.busy = busy  # the run dir is another job's or watcher's now: may be free later


def _fail(code: int, message: str) -> "typer.Exit":
    print(f"slurmft watch: {message}", file=sys.stderr, flush=True)
    return typer.Exit(code)


class RunFactory:
    """Turns a Job into a locked RunWatch: owner and run dir checked, state loaded."""

    def __init__(self, client, cfg, listeners, recorder, explicit_run_dir: Path | None, *,
                 once: bool = False) -> None:
        self.client, self.cfg, self.listeners, self.recorder = client, cfg, listeners, recorder
        self.once = once
        self.explicit = explicit_run_dir
        self.locks: dict[Path, Any] = {}  # run dir -> its RunLock
        self.failed_code = 0  # a named job taken on late that could not be watched
        self._told: set[str] = set()  # --all: jobs whose refusal was logged


    def make(self, job):
        from slurmft.rundir import RunDir
        from slurmft.watch.resolve import ResolveError, check_owner, run_dir_for
        from slurmft.watch.runwatch import RunWatch
        from slurmft.slurm.client import SlurmError
        from slurmft.watch.state import (
            FOLLOW, NEW_EPOCH, RESUBMISSION, LockError, RunBusy, RunLock, StateError, load_state, released_after_giving_up,
            save_state, take_on,
        )

        try:
            check_owner(job)
            path = run_dir_for(job, self.explicit)
        except ResolveError as exc:
            raise WatchStartError(EXIT_USAGE, str(exc)) from None
        if path in self.locks:
            raise WatchStartError(EXIT_USAGE, f"two of the jobs write the same run dir {path}",
                                  busy=True)
        rd = RunDir(path)
        lock = RunLock(rd, lease_s=self.cfg.lease_s)
        try:
            lock.acquire()
        except LockError as exc:
            raise WatchStartError(EXIT_LOCKED, str(exc), busy=True) from None
        try:
            state = load_state(rd, job.job_id)
            saved = copy.deepcopy(state)  # as on disk: what take_on changes is written at the first save
            how = take_on(state, job.job_id, time.time(), lambda: self._current(state.job_id))
        except StateError as exc:
            lock.release()
            raise WatchStartError(EXIT_USAGE, f"{path}: {exc}" if str(path) not in str(exc)
                                  else str(exc), busy=isinstance(exc, RunBusy)) from None
        except SlurmError as exc:
            lock.release()
            raise WatchStartError(EXIT_SLURM, f"cannot tell whether job {state.job_id}, the run dir "
                                  f"{path}'s current job, has ended: {exc}") from None
        if how == FOLLOW:
            log.warning("job %s ran in run dir %s before: watching its current job %s",
                        job.job_id, path, state.job_id)
            try:
                current = self._current(state.job_id)
            except SlurmError as exc:
                lock.release()
                raise WatchStartError(EXIT_SLURM, f"cannot look up job {state.job_id}: {exc}") from None
            if current is not None:
                job = current
        elif how in (NEW_EPOCH, RESUBMISSION):
            log.warning("job %s is a %s in run dir %s (epoch %d)", job.job_id,
                        "new job" if how == NEW_EPOCH else "resubmission", path, len(state.epochs))
            try:
                save_state(rd, state)
                saved = copy.deepcopy(state)
            except OSError as exc:
                lock.release()
                raise WatchStartError(EXIT_USAGE, f"cannot write {rd.watch_state}: {exc.strerror}") from None
        if job.job_id == state.job_id:
            released_after_giving_up(state, job)
        self.locks[path] = lock
        return RunWatch(rd, state, self.client, self.cfg, self.listeners, self.recorder, once=self.once,
                        saved=saved, lock=lock)

    def _current(self, job_id: str):
        """Slurm's view of ``job_id`` (accounting included), or None when Slurm forgot it."""
        from slurmft.slurm.client import JobNotFound

        try:
            return self.client.job(job_id)
        except JobNotFound:
            return None

    def start_later(self, job):
        """A named job that has now named its run dir; one that cannot be watched is reported
        (the watcher exits non-zero at the end) and the others go on."""
        try:
            return self.make(job)
        except WatchStartError as exc:
            print(f"slurmft watch: {exc}", file=sys.stderr, flush=True)
            self.failed_code = self.failed_code or exc.code
            return None

    def adopt(self, job):
        """``--all``: a new job of the user; one that cannot be watched is logged and skipped,
        one whose run dir is busy (its current job still alive, another watcher) asked for again
        next cycle (``AdoptLater``), said once."""
        from slurmft.watch.loop import AdoptLater

        try:
            run = self.make(job)
        except WatchStartError as exc:
            if job.job_id not in self._told:
                self._told.add(job.job_id)
                log.warning("not watching job %s%s: %s", job.job_id, " yet" if exc.busy else "", exc)
            if exc.busy:
                raise AdoptLater(str(exc)) from None
            return None
        self._told.discard(job.job_id)
        log.warning("watching job %s (run dir %s)", job.job_id, run.run_dir.root)
        return run

    def let_go(self, run) -> None:
        """``--all``: a run that ended; its lock is released so a new job there can be taken on."""
        lock = self.locks.pop(run.run_dir.root, None)
        if lock is not None:
            lock.release()
        log.warning("job %s: %s; no longer watched", run.job_id, run.state.phase)

    def release(self) -> None:
        for lock in self.locks.values():
            lock.release()
        self.locks.clear()


def watch(
    job_ids: Optional[List[str]] = typer.Argument(None, metavar="[JOBID...]", help="Jobs to watch."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="The run dir (one job only); "
                                           "default: the job comment SLURMFT_RUN_DIR=..."),
    user: Optional[str] = typer.Option(None, "--user", help="With --all: whose jobs (yourself)."),
    all_jobs: bool = typer.Option(False, "--all", help="Also watch every job of --user that "
                                  "names a run dir, including jobs submitted later."),
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
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Serve Prometheus "
                                               "metrics on 127.0.0.1:PORT."),
    textfile: Optional[Path] = typer.Option(None, "--textfile", help="Write the metrics to this "
                                            "node_exporter textfile (*.prom) every cycle."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every event to stderr."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print no line per event and no live "
                               "status (warnings and the end still go to stderr/stdout)."),
    record: Optional[Path] = typer.Option(None, "--record", hidden=True,
                                          help="Append every observation to this JSONL file "
                                               "(detector test fixtures)."),
) -> None:
    """Watch jobs and bring every failed run back: requeue, exclude bad nodes, start now, hold."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where is it stuck?
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="slurmft-watch %(asctime)s %(levelname)s %(message)s")
    from slurmft.slurm import validate
    from slurmft.slurm.cli import CliSlurmClient
    from slurmft.commands.joblookup import LookupFailed, find_job
    from slurmft.slurm.config import SlurmConfig
    from slurmft.watch.config import WatchConfig
    from slurmft.watch.loop import Watcher
    from slurmft.watch.resolve import StartWait, current_user, waiting_for_start
    from slurmft.watch.runwatch import Listener

    ids = list(job_ids or [])
    try:
        overrides = {"poll_s": poll, "hang_timeout_s": hang_timeout,
                     "operator": True if operator else None}
        cfg = load_section(WatchConfig, "watch", config_file=config,
                           overrides={k: v for k, v in overrides.items() if v is not None})
        client = CliSlurmClient(load_section(SlurmConfig, "slurm", config_file=config))
        ids = validate.job_ids(ids)
        if user is not None:
            validate.user_name(user)
        hook = shlex.split(on_event) if on_event else None
    except (ConfigError, ValueError) as exc:
        raise _fail(EXIT_USAGE, str(exc))
    if all_jobs != (user is not None):
        raise _fail(EXIT_USAGE, "--all and --user go together: --user USER --all")
    if user is not None and user != current_user():
        raise _fail(EXIT_USAGE, f"--user {user}: the watcher runs as the jobs' owner; run it as "
                    f"{user} (you are {current_user()})")
    if not ids and not all_jobs:
        raise _fail(EXIT_USAGE, "give at least one JOBID (or --user USER --all)")
    if len(set(ids)) != len(ids):
        raise _fail(EXIT_USAGE, "a job id is given twice")
    if run_dir is not None and (len(ids) != 1 or all_jobs):
        raise _fail(EXIT_USAGE, "--run-dir names the run dir of ONE job; give one JOBID with it")
    if on_event is not None and not hook:
        raise _fail(EXIT_USAGE, "--on-event is empty")
    if metrics_port is not None and not 0 < metrics_port < 65536:
        raise _fail(EXIT_USAGE, f"--metrics-port {metrics_port} is not a TCP port (1-65535)")
    if textfile is not None and (textfile.suffix != ".prom" or not textfile.parent.is_dir()):
        raise _fail(EXIT_USAGE, f"--textfile {textfile}: must end in .prom, in an existing directory")

    listeners: list[Listener] = []
    if hook:
        from slurmft.watch.notify import run_hook

        listeners.append(lambda kind, event: run_hook(hook, {"kind": kind, **event}, timeout_s=10.0))
    metrics = None
    if metrics_port is not None or textfile is not None:
        from slurmft.watch.metrics import MetricsError, WatchMetrics
        from slurmft.watch.metrics_feed import MetricsFeed

        metrics = WatchMetrics()
        listeners.append(metrics.on_event)
        if metrics_port is not None:
            try:
                metrics.serve(metrics_port)
            except MetricsError as exc:
                raise _fail(EXIT_USAGE, str(exc))
    from slurmft.watch.console import console_for

    console = console_for(quiet, sys.stdout)
    if console is not None:
        listeners.append(console.on_event)
    recorder = None
    if record is not None:
        from slurmft.watch.record import Recorder

        recorder = Recorder(record)
    factory = RunFactory(client, cfg, listeners, recorder, run_dir, once=once)
    try:
        runs = []
        try:
            jobs = [find_job(client, job_id) for job_id in ids]
        except LookupFailed as exc:
            raise _fail(exc.code, str(exc))
        later = [j.job_id for j in jobs if run_dir is None and waiting_for_start(j)]
        if later:
            names = ", ".join(later)
            print(f"slurmft watch: job(s) {names} have not started (no run dir named yet): "
                  + ("nothing to watch for them in this cycle" if once else
                     "watching them once they name it, the others meanwhile (--run-dir skips the wait)"),
                  file=sys.stderr, flush=True)
        for job in jobs:
            if job.job_id in later:
                continue
            try:
                runs.append(factory.make(job))
            except WatchStartError as exc:
                raise _fail(exc.code, str(exc))
        wait = StartWait(later, cfg.startup_grace_s) if later and not once else None
        feed = MetricsFeed(metrics, textfile) if metrics is not None else None
        hooks = [h.after_cycle for h in (feed, console) if h is not None]

        def after_cycle(result) -> None:
            for hook in hooks:
                hook(result)
        watcher = Watcher(client, runs, poll_s=cfg.poll_s, user=user,
                          adopt=factory.adopt if all_jobs else None,
                          on_cycle=after_cycle if hooks else None,
                          let_go=factory.let_go if all_jobs else None,
                          forget=feed.forget if feed is not None else None,
                          waiting=wait, start=factory.start_later)
        failed: dict[str, str] = {}
        try:
            if once:
                result = watcher.cycle()
                if not result.observed:
                    raise _fail(EXIT_SLURM, f"could not observe Slurm: {result.error}")
                failed = result.failed
            else:
                watcher.run()
        except KeyboardInterrupt:
            if console is not None:
                console.close()
            print("slurmft watch: interrupted; state is saved, start it again to carry on",
                  file=sys.stderr)
        if console is not None:
            console.close()
        for run in watcher.runs:
            print(f"job {run.job_id}: {run.state.phase}"
                  + (f" ({run.state.reason})" if run.state.reason else ""))
        for job_id, why in sorted(failed.items()):
            print(f"slurmft watch: job {job_id}: this cycle failed: {why}", file=sys.stderr)
        refused = wait.refused if wait is not None else []
        for why in refused:
            print(f"slurmft watch: not watched: {why}", file=sys.stderr)
        if refused or factory.failed_code:
            raise typer.Exit(factory.failed_code or EXIT_USAGE)
        if failed:
            raise typer.Exit(EXIT_CYCLE_FAILED)
    finally:
        if console is not None:
            console.close()
        factory.release()
        if metrics is not None:
            metrics.stop()


app = watch
