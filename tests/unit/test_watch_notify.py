"""``slurmft.watch.notify.run_hook`` with real commands: the event arrives as JSON on stdin; a
failing, missing, slow or chatty hook is reported, never raised, and never holds the watcher."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from datetime import datetime, timezone

import pytest

from procs import alive
from slurmft.watch.notify import MAX_OUTPUT, run_hook

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
EVENT = {"kind": "fault_detected", "job_id": "42", "cause": "node_down", "nodes": ["n2"],
         "fault_time": 1700000000.5}


def test_the_event_arrives_as_one_json_object_on_stdin(tmp_path):
    out = tmp_path / "got.json"
    code = f"import sys, shutil; shutil.copyfileobj(sys.stdin, open({str(out)!r}, 'w')); print('sent')"
    result = run_hook([PY, "-c", code], EVENT, timeout_s=30)
    assert result.ok and result.returncode == 0 and not result.timed_out, result
    assert json.loads(out.read_text()) == EVENT
    assert result.output == "sent\n"


def test_values_json_cannot_hold_are_still_sent_as_valid_json(tmp_path):
    # Strict JSON on the hook's side: NaN (which Python's json would write) is refused there.
    code = ("import sys, json; e = json.load(sys.stdin, parse_constant=lambda c: sys.exit(f'not JSON: {c}')); "
            "print(e['when'], e['bad'])")
    event = {"when": datetime(2026, 1, 2, tzinfo=timezone.utc), "bad": math.nan}
    result = run_hook([PY, "-c", code], event, timeout_s=30)
    assert result.ok and result.output.strip() == "2026-01-02 00:00:00+00:00 None", result


def test_a_failing_hook_is_reported_with_its_output(caplog):
    result = run_hook([PY, "-c", "import sys; print('no webhook'); sys.exit(3)"], EVENT, timeout_s=30)
    assert not result.ok and result.returncode == 3
    assert result.error.endswith("exited with 3") and result.output == "no webhook\n"
    assert "exited with 3 (output: no webhook)" in caplog.text


@pytest.mark.parametrize("argv,error", [
    (["/nonexistent/notify-me"], "cannot run /nonexistent/notify-me: No such file or directory"),
    ("echo hi", "is not a non-empty list of arguments"),
    ([], "is not a non-empty list of arguments"),
    (["echo", ""], "is not a non-empty list of arguments"),
])
def test_a_hook_that_cannot_run_is_reported_not_raised(argv, error):
    result = run_hook(argv, EVENT, timeout_s=5)
    assert not result.ok and result.returncode is None and error in result.error


def test_a_slow_hook_is_killed_with_its_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {pidfile}; echo started; wait"
    result = run_hook(["sh", "-c", script], EVENT, timeout_s=1.0)
    assert result.timed_out and not result.ok and result.returncode is None
    assert "did not finish within 1 s: killed" in result.error and result.output == "started\n"
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the hook's child outlived the timeout"


def test_output_is_bounded_and_a_chatty_hook_never_blocks():
    code = "import sys; sys.stdout.write('x' * 20_000_000); sys.stdout.flush()"
    result = run_hook([PY, "-c", code], EVENT, timeout_s=30)
    assert result.ok and len(result.output) == MAX_OUTPUT


def test_a_hook_that_ignores_a_large_event_is_fine():
    big = {**EVENT, "evidence": "y" * 2_000_000}
    assert run_hook(["true"], big, timeout_s=30).ok


def test_a_hook_whose_background_child_keeps_stdout_open_is_not_waited_for(tmp_path):
    pidfile = tmp_path / "child.pid"
    result = run_hook(["sh", "-c", f"sleep 120 & echo $! > {pidfile}; exit 0"], EVENT, timeout_s=30)
    try:
        assert result.ok and not result.timed_out
    finally:
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
