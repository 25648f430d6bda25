"""Running ``srun`` from the launcher with a bound: a child in its own process group, ended with
TERM (srun forwards it to the step's tasks) and then KILL when it outlives its time."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Sequence

KILL_AFTER_S = 10.0   # after the TERM, before the KILL


def start(argv: Sequence[str], env: Mapping[str, str] | None = None, *,
          capture: bool = False) -> subprocess.Popen:
    """Start ``argv`` in a new process group (so a TERM sent to it reaches only it)."""
    return subprocess.Popen(list(argv), env=None if env is None else dict(env),
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.STDOUT if capture else None,
                            start_new_session=True)


def stop(proc: subprocess.Popen, *, kill_after_s: float = KILL_AFTER_S) -> None:
    """TERM, then KILL after ``kill_after_s``; reaps the child. The pid is ours until reaped."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=kill_after_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=kill_after_s)
        except subprocess.TimeoutExpired:
            pass  # unkillable (blocked in the kernel, e.g. on a hung filesystem): not waited on


def run_bounded(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
                ) -> tuple[int | None, str]:
    """(rc, combined output); rc None when ``argv`` was stopped after ``timeout`` seconds."""
    proc = start(argv, env, capture=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        stop(proc)
        try:
            out, _ = proc.communicate(timeout=KILL_AFTER_S)
        except subprocess.TimeoutExpired:  # something still holds the pipe: give up on its output
            return None, ""
        return None, out.decode(errors="replace")
