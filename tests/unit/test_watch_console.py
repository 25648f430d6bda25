"""What ``slurmft watch`` prints: a crash's recovery driven through the real ``RunWatch`` (the
per-run state machine the watch loop steps) with constructed observations and a client that
records what it is asked (as in test_watch_runwatch.py), in a child process whose stdout is a
pseudo-terminal, a pipe, or systemd's journal stream."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

from slurmft.watch.console import console_for, describe, duration

CHILD = textwrap.dedent("""
    import sys
    from dataclasses import replace
    from datetime import datetime, timezone
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from unit.test_watch_runwatch import NODES, RecordingClient, T0, at, job
    from slurmft.rundir import RunDir
    from slurmft.slurm.client import JobState
    from slurmft.watch.config import WatchConfig
    from slurmft.watch.console import console_for
    from slurmft.watch.loop import CycleResult
    from slurmft.watch.runwatch import RunWatch
    from slurmft.watch.state import RunState

    rd = RunDir(Path({run!r}))
    rd.root.mkdir()
    console = console_for(quiet={quiet}, stream=sys.stdout)
    listeners = [console.on_event] if console is not None else []
    w = RunWatch(rd, RunState(job_id="7"), RecordingClient(), WatchConfig(start_now_delay_s=1.5),
                 listeners)
    for now, seen in [(10, job()), (12, job(JobState.FAILED, exit_code=1, end_time=at(11))),
                      (14, job(JobState.PENDING, restart=1, nodes=())),
                      (15.6, job(JobState.PENDING, restart=1, nodes=())),
                      (100, replace(job(restart=1), start_time=at(95)))]:
        w.step(seen, NODES, T0 + now)
        if console is not None:
            console.after_cycle(CycleResult(observed=True, duration_s=0.1, runs=[w]))
    if console is not None:
        console.close()
    print("END")
""")


def child(tmp_path, *, quiet: bool = False) -> str:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return CHILD.format(tests=tests, run=str(tmp_path / "run"), quiet=quiet)


def run_in_pty(code: str, env: dict[str, str]) -> str:
    """Runs ``code`` with stdout and stderr on a pseudo-terminal; returns what it wrote."""
    primary, secondary = os.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=secondary, stderr=secondary,
                            stdin=subprocess.DEVNULL, env=env, close_fds=True)
    os.close(secondary)
    out = b""
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, f"the child under a pty did not end: {out!r}"
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(primary)
    assert proc.wait(timeout=60) == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")


def env_without_journal(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    return {**env, "TERM": "xterm", "COLUMNS": "120", **extra}


def test_a_recovery_is_printed_on_a_terminal_without_flags(tmp_path):
    out = run_in_pty(child(tmp_path), env_without_journal())
    text = plain(out)
    assert "job 7: watching (run dir" in text
    assert "job 7: fault: crash" in text
    assert "job 7: requeue (crash)" in text
    assert "job 7: start_now (crash)" in text
    # fault at 11 s (the job's end), running again at 95 s: 1m24s
    assert "job 7: running again on n[1-2] after crash; recovery took 1m24s (fault to start)" in text
    assert "\x1b[" in out  # the live status lines (rich) were drawn: a terminal
    assert "restarts 1" in text  # ... and one of them showed the run's restarts


def test_under_systemd_the_same_lines_are_plain_and_there_is_no_live_line(tmp_path):
    out = run_in_pty(child(tmp_path), env_without_journal(JOURNAL_STREAM="8:1234"))
    assert "\x1b[" not in out
    lines = [line for line in out.replace("\r", "").splitlines() if line]
    assert lines[-1] == "END"
    events = [line for line in lines if re.match(r"\d\d:\d\d:\d\d job 7: ", line)]
    assert len(events) == 5  # watching, fault, requeue, start_now, running again
    assert events[-1].endswith("recovery took 1m24s (fault to start)")
    assert "restarts 1" not in out


def test_a_pipe_gets_the_event_lines_too(tmp_path):
    proc = subprocess.run([sys.executable, "-c", child(tmp_path)], capture_output=True, text=True,
                          env=env_without_journal(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "recovery took 1m24s" in proc.stdout and "\x1b[" not in proc.stdout


def test_quiet_prints_nothing(tmp_path):
    out = run_in_pty(child(tmp_path, quiet=True), env_without_journal())
    assert "END" in out and "fault: crash" not in out and "recovery took" not in out
    assert not re.search(r"\d\d:\d\d:\d\d job 7: ", out)  # no event line (a warning may still be)
    assert "\x1b[" not in out
    assert console_for(True, sys.stdout) is None


def test_event_lines():
    assert describe("gave_up", {"job_id": "7", "cause": "crash", "restarts": 3,
                                "reason": "max_restarts (3) reached"}) == \
        "job 7: GAVE UP (crash) after 3 restart(s): max_restarts (3) reached; the job is held"
    assert describe("recovery_action", {"job_id": "7", "action": "exclude", "cause": "node_death",
                                        "nodes": ["gpu3", "gpu1", "gpu2"], "ok": False,
                                        "detail": "Invalid node name"}) == \
        "job 7: exclude on gpu[1-3] FAILED (node_death): Invalid node name"
    assert describe("checkpoint_committed", {"job_id": "7"}) is None
    assert [duration(s) for s in (0, 59.6, 61, 3600 * 2 + 7 * 60, 86400 * 3 + 3600 * 4)] == \
        ["0s", "1m00s", "1m01s", "2h07m", "3d04h"]


def test_a_node_name_hostlist_refuses_is_printed_as_it_is():
    assert describe("fault_detected", {"job_id": "7", "cause": "hang", "nodes": ["x,y", "n1"],
                                       "evidence": "no beat"}) == "job 7: fault: hang on x,y,n1: no beat"
