"""StepWatchdog: a hung step ends the process with the HANG code and all stacks in the log."""

import subprocess
import sys
import textwrap
import time

import pytest

from slurmft import exitcodes
from slurmft.train.watchdog import DEADLINE_SLACK_S, StepWatchdog, _Watch

HANGING = textwrap.dedent("""
    import threading, time
    from slurmft.train.watchdog import StepWatchdog
    fired = []
    dog = StepWatchdog(timeout_s={timeout}, on_fire=fired.append).start()
    for step in range(3):
        dog.step_started(step)
        time.sleep(0.01)
        dog.step_finished()
    def helper_thread_body():
        time.sleep(60)
    threading.Thread(target=helper_thread_body, daemon=True).start()
    dog.step_started(3)
    def stuck_in_collective():
        time.sleep(60)
    stuck_in_collective()
""")


@pytest.mark.timeout(60)
def test_hanging_step_dumps_stacks_and_exits_with_hang_code():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HANGING.format(timeout=1.0)],
                          capture_output=True, text=True, timeout=50)
    elapsed = time.monotonic() - t0
    assert proc.returncode == exitcodes.HANG, proc.stderr
    assert elapsed < 20
    assert "step 3 has run" in proc.stderr
    assert "stuck_in_collective" in proc.stderr and "helper_thread_body" in proc.stderr


def test_adaptive_deadline_after_warmup():
    dog = StepWatchdog(safety_factor=4, warmup_steps=3, min_timeout_s=0.5)
    assert dog.deadline_s() is None
    dog._durations.extend([0.2, 0.3, 10.0])
    assert dog.deadline_s() == pytest.approx(1.2)
    dog._durations.clear()
    dog._durations.extend([0.01] * 3)
    assert dog.deadline_s() == 0.5


def test_fast_steps_never_fire():
    exits = []
    dog = StepWatchdog(timeout_s=0.5, poll_s=0.02, _exit=exits.append).start()
    try:
        for step in range(20):
            dog.step_started(step)
            time.sleep(0.01)
            dog.step_finished()
        time.sleep(0.7)  # idle between steps is not watched
    finally:
        dog.stop()
    assert exits == []


def test_the_thread_looks_again_just_past_the_deadline_in_sight_not_a_poll_later():
    """A 1 s poll and a step of limit 10 s started at t=0: it looks every second until the
    deadline is less than a poll away, then just past it (at 10.01 s, not at up to 11 s)."""
    step = (_Watch("step 1", 0.0, None), 10.0)
    look = StepWatchdog._next_look
    assert look(None, 1.0, 5.0) == 1.0                      # nothing watched: the poll
    assert look(step, 1.0, 3.0) == 1.0
    assert look(step, 1.0, 9.4) == pytest.approx(0.6 + DEADLINE_SLACK_S)
    assert look(step, 1.0, 10.5) == DEADLINE_SLACK_S        # past it: it fires on this look


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        StepWatchdog(timeout_s=0)
    with pytest.raises(ValueError):
        StepWatchdog(safety_factor=1)


# The exit must not depend on the run dir's filesystem: each script below makes reporting hang
# in a different way, and the process must still end within a bound.
BLOCKED_REPORT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from slurmft.journal import Journal
    from slurmft.train.watchdog import StepWatchdog
    run_dir = Path(sys.argv[1])
    {setup}
    dog = StepWatchdog(timeout_s=0.5, report_timeout_s=1.0, poll_s=0.05, **kwargs).start()
    dog.step_started(7)
    print("watching", flush=True)
    time.sleep(60)
""")

JOURNAL_ON_A_FIFO = """
os.mkfifo(run_dir / "events.jsonl")
journal = Journal(run_dir)
def on_fire(message):
    with open(run_dir / "events.jsonl", "w"):  # blocks: no reader, like a hung mount
        pass
    journal.append("hang", message=message)  # (the journal itself refuses a FIFO at once)
kwargs = dict(on_fire=on_fire)
"""

HOOK_THAT_SLEEPS = """
kwargs = dict(on_fire=lambda message: time.sleep(3600))
"""

# faulthandler writes the stacks to the stream's descriptor while holding the GIL; a pipe that is
# already full blocks that write, so every Python thread stops, the watchdog's own wait included.
STREAM_ON_A_FULL_PIPE = """
import fcntl
read_end, write_end = os.pipe()
fcntl.fcntl(write_end, fcntl.F_SETFL, os.O_NONBLOCK)
try:
    while True:
        os.write(write_end, b"x" * 65536)
except BlockingIOError:
    pass
fcntl.fcntl(write_end, fcntl.F_SETFL, 0)
class Stream:
    def write(self, text): return len(text)
    def flush(self): pass
    def fileno(self): return write_end
kwargs = dict(stream=Stream())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setup, code", [
    (JOURNAL_ON_A_FIFO, exitcodes.HANG),
    (HOOK_THAT_SLEEPS, exitcodes.HANG),
    (STREAM_ON_A_FULL_PIPE, 1),  # the GIL-free backstop: faulthandler's own thread ends it
], ids=["journal-on-a-fifo", "hook-that-sleeps", "stream-on-a-full-pipe"])
def test_exit_happens_within_a_bound_when_reporting_hangs(tmp_path, setup, code):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", BLOCKED_REPORT.format(setup=setup), str(tmp_path)],
                          capture_output=True, text=True, timeout=40)
    elapsed = time.monotonic() - t0
    assert proc.stdout == "watching\n", proc.stderr
    assert proc.returncode == code, proc.stderr
    assert elapsed < 30, elapsed  # 0.5 s step timeout + 1 s report bound (+2 s backstop) + start-up


def test_a_phase_is_watched_and_pauses_the_step_around_it():
    exits, fired = [], []
    dog = StepWatchdog(timeout_s=0.3, poll_s=0.02, on_fire=fired.append, _exit=exits.append).start()
    try:
        dog.step_started(1)
        with dog.phase("checkpoint save of step 1", timeout_s=5.0):
            time.sleep(0.6)  # longer than the step's timeout: the step's clock is paused
        assert dog.step_finished() < 0.3
        assert exits == []
        with dog.phase("checkpoint save of step 2", timeout_s=0.2):
            deadline = time.monotonic() + 10
            while not exits and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        dog.stop()
    assert exits == [exitcodes.HANG]
    assert fired and "checkpoint save of step 2 has run" in fired[0]
