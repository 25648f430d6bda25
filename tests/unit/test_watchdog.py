"""StepWatchdog: a hung step ends the process with the HANG code and all stacks in the log."""

import subprocess
import sys
import textwrap
import time

import pytest

from slurmft import exitcodes
from slurmft.train.watchdog import StepWatchdog

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


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        StepWatchdog(timeout_s=0)
    with pytest.raises(ValueError):
        StepWatchdog(safety_factor=1)
