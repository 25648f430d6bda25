"""Signals reach only the launcher's own step; a signal before training is judged against what
Slurm says about THIS run; the outcome of THIS segment decides the exit code."""

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from launch_envs import recorded
from slurmft.launch import identity
from slurmft.launch.outcome import Next, decide
from slurmft.launch.signals import SignalLog, is_for_this_run
from slurmft.launch.step import run_step
from slurmft.slurm.client import Job, JobState

pytestmark = pytest.mark.timeout(60)
NOW = datetime(2026, 11, 24, 21, 0, tzinfo=timezone.utc)
IDENT = identity.from_environ({**recorded("array-task1"), "SLURM_RESTART_COUNT": "2"})


def _job(state=JobState.RUNNING, flags=(), restarts=2, end_in_s=3600):
    end = None if end_in_s is None else NOW + timedelta(seconds=end_in_s)
    return Job(job_id="2_1", name="t", state=state, flags=frozenset(flags), restart_count=restarts,
               time_limit_end=end)


@pytest.mark.parametrize("job, act, needle", [
    (None, True, "no scontrol"),
    (_job(state=JobState.PENDING), True, "Slurm is ending this run (JobState=PENDING)"),
    (_job(flags={"COMPLETING"}), True, "COMPLETING"),
    (_job(restarts=3), True, "Slurm counts 3 restarts, this run is 2"),
    (_job(end_in_s=150), True, "the time limit is 150 s away"),   # @120 may come 60 s early
    (_job(), False, "meant for an earlier run"),
    (_job(end_in_s=None), False, "meant for an earlier run"),   # no time limit
])
def test_signal_before_training_is_judged_by_what_slurm_says_about_this_run(job, act, needle):
    acted, why = is_for_this_run(job, IDENT, now=NOW)
    assert acted is act and needle in why


@pytest.mark.parametrize("recorded_code, srun_rc, nxt, code", [
    (0, 1, Next.FINISHED, 0),
    (85, 1, Next.REQUEUE, 85),
    (86, 1, Next.NO_REQUEUE, 86),
    (87, 1, Next.PASS_ON, 87),
    (None, 0, Next.FINISHED, 0),
    (None, 137, Next.PASS_ON, 137),
    (None, 86, Next.PASS_ON, 1),   # 86 only when training recorded it deliberately
])
def test_outcome_of_this_segment_decides(recorded_code, srun_rc, nxt, code):
    decision = decide(recorded_code, srun_rc)
    assert (decision.next, decision.code) == (nxt, code)


COUNTER = r"""
import signal, sys, time
got = []
signal.signal(signal.SIGUSR2, lambda *a: got.append(1))
open(sys.argv[1], "w").close()
deadline = time.monotonic() + 30
while len(got) < int(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.05)
open(sys.argv[1], "w").write(str(len(got)))
sys.exit(85 if got else 3)
"""


def _counter(path, want):
    # Started with USR2 ignored (as slurmft.launch.task starts torchrun): a signal that comes
    # before the handler is installed is lost, not fatal, and the re-send makes up for it.
    return ["bash", "-c", 'trap "" USR2; exec "$@"', "counter", sys.executable, "-c", COUNTER,
            str(path), str(want)]


def _wait_file(path):
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_signal_is_forwarded_to_the_own_child_only_and_resent_until_it_ends(tmp_path):
    bystander_file = tmp_path / "bystander"
    bystander = subprocess.Popen(_counter(bystander_file, 1))  # same user, same session: untouched
    _wait_file(bystander_file)
    log = SignalLog()
    forwarded = []
    child_file = tmp_path / "child"
    # the child wants 2 signals: one forwarded, one re-sent after the 1 s floor
    rc = run_step(_counter(child_file, 2), os.environ, log, 1.0, forwarded.append, pending=["TERM"])
    assert rc == 85 and forwarded == ["TERM"] and child_file.read_text() == "2"
    time.sleep(0.3)
    assert bystander.poll() is None  # never signalled
    bystander.kill()
    bystander.wait()


def test_signals_received_during_the_step_are_taken_and_forwarded(tmp_path):
    log = SignalLog()
    forwarded = []
    child_file = tmp_path / "child"
    start_signal = []

    def start(argv, env):
        proc = subprocess.Popen(argv, env=env)
        start_signal.append(proc)
        return proc

    log.received.append(("USR2", time.monotonic()))  # as the handler does on a real USR2
    rc = run_step(_counter(child_file, 1), os.environ, log, 5.0, forwarded.append, start=start)
    assert rc == 85 and forwarded == ["USR2"] and log.received == []


def test_handler_only_records(tmp_path):
    log = SignalLog()
    old = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        log.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert log.take() == ["USR2", "TERM"] and log.take() == []
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def test_a_child_that_survives_sigkill_is_not_waited_for_forever(monkeypatch):
    # A process blocked in the kernel (a hung Lustre mount) does not die at SIGKILL: the launcher
    # stops waiting after its bound instead of hanging the job with it.
    from slurmft.launch import procs

    class Unkillable:
        pid = 999999999
        waits = 0

        def poll(self):
            return None

        def send_signal(self, sig):
            pass

        def wait(self, timeout=None):
            assert timeout is not None, "an unbounded wait"
            self.waits += 1
            raise subprocess.TimeoutExpired("x", timeout)

    monkeypatch.setattr(procs.os, "killpg", lambda pid, sig: None)
    child = Unkillable()
    procs.stop(child, kill_after_s=0.01)
    assert child.waits == 2
