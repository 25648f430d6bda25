"""Support for the watcher's integration tests: run the real ``slurmft watch`` CLI as a process
against the devcluster and observe jobs WITHOUT acting on them: every action is the watcher's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurmft.journal import Event, read_events
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job


# Set to a directory to capture detector fixtures: each watcher's observations (--record) and a
# copy of its run's journal land there (see tests/fixtures/watch/README.md).
CAPTURE_ENV = "SLURMFT_WATCH_CAPTURE_DIR"


def _ctrl_c_interrupts() -> None:
    """In the child: SIGINT interrupts, as in a user's terminal. A suite started in the background
    by a shell without job control (``bash .ci/run &``) inherits SIGINT ignored, and Python then
    never raises KeyboardInterrupt: the watcher would not stop when a test "presses Ctrl-C"."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class WatcherProc:
    def __init__(self, cluster, job_ids: list[str], log: Path, *args: str,
                 env: dict[str, str] | None = None, run_dir: Path | None = None) -> None:
        self.log = log
        self.run_dir = run_dir
        full_env = {**os.environ, **cluster.env, **(env or {})}
        capture = os.environ.get(CAPTURE_ENV)
        self.capture = Path(capture) / log.stem if capture else None
        if self.capture is not None:
            self.capture.mkdir(parents=True, exist_ok=True)
            args = (*args, "--record", str(self.capture / "records.jsonl"))
        self._fh = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slurmft.cli", "watch", *job_ids, "--poll", "1", "-v", *args],
            env=full_env, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_ctrl_c_interrupts)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"watcher did not exit within {timeout:.0f} s\n{self.text()[-4000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            if sig == signal.SIGKILL:  # leave its stacks in the log first (faulthandler on USR1)
                os.kill(self.proc.pid, signal.SIGUSR1)
                time.sleep(0.3)
            os.killpg(self.proc.pid, sig)
            self.proc.wait(10)
        self._fh.close()
        if self.capture is not None and self.run_dir is not None:
            shutil.copyfile(RunDir(self.run_dir).events, self.capture / "events.jsonl")


def observe_until(client, job_id: str, predicate, timeout: float, what: str, *,
                  context=lambda: "") -> Job:
    """Poll the job (observing only) until ``predicate(job)``."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.job(job_id)
        if predicate(job):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id}: no {what} within {timeout:.0f} s; last state "
                                 f"{job.state.value} ({job.reason}), restart {job.restart_count}"
                                 f"\n{context()[-6000:]}")
        time.sleep(0.5)


def events_until(run_dir: Path, predicate, timeout: float, what: str, *,
                 context=lambda: "") -> list[Event]:
    """Poll the run's journal until ``predicate(events)``."""
    deadline = time.monotonic() + timeout
    while True:
        events = read_events(RunDir(run_dir).events)
        if predicate(events):
            return events
        if time.monotonic() > deadline:
            kinds = [e.kind for e in events][-30:]
            raise AssertionError(f"no {what} within {timeout:.0f} s; last events {kinds}"
                                 f"\n{context()[-6000:]}")
        time.sleep(0.5)


def of(events: list[Event], kind: str, **match) -> list[Event]:
    return [e for e in events if e.kind == kind and all(e.get(k) == v for k, v in match.items())]
