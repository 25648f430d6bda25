"""Run one external program for a health source: argv list, validated, always with a timeout.

Health sources (dcgmi, site scripts) are not Slurm commands; they are run here and nowhere else
in ``slurmft.health``. A program runs in its own process group, which is killed when it ends,
when it overruns its timeout, or when it prints more than ``MAX_OUTPUT_BYTES`` (a check printing
without end must not grow the root sweep's memory): its children never outlive it, and a child
holding the output pipe open cannot stretch its timeout.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Sequence

MAX_OUTPUT_BYTES = 1 << 20
REAP_S = 10.0  # how long a killed check is waited for (one stuck in the kernel cannot die)


@dataclass(frozen=True)
class ProcResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: killed after the timeout
    output: str  # stdout and stderr as they came, decoded leniently, at most MAX_OUTPUT_BYTES
    overflowed: bool = False  # printed more than MAX_OUTPUT_BYTES: killed, output cut

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def validate_argv(argv: Sequence[str], where: str) -> tuple[str, ...]:
    """A non-empty list of non-empty strings without NUL bytes, else ValueError naming ``where``."""
    if isinstance(argv, str) or not isinstance(argv, (list, tuple)) or not argv:
        raise ValueError(f"{where} must be a non-empty list of strings")
    for i, arg in enumerate(argv):
        if not isinstance(arg, str) or not arg or "\0" in arg:
            raise ValueError(f"{where}[{i}] must be a non-empty string without NUL bytes")
    return tuple(argv)


def run(argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None,
        max_output: int = MAX_OUTPUT_BYTES) -> ProcResult:
    """Run ``argv`` (no shell) with stdin closed, in its own process group; see the module doc."""
    args = validate_argv(argv, "argv")
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, env=env,
    )
    deadline = time.monotonic() + timeout_s
    try:
        output, overflowed, in_time = _collect(proc, deadline, max_output)
        in_time = in_time and not overflowed and _exited_by(proc.pid, deadline)
    finally:
        _kill_group(proc.pid)  # the leader is not reaped yet, so its group id is still ours
        proc.stdout.close()  # type: ignore[union-attr]
        try:
            proc.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            pass  # blocked in the kernel (a hung mount) even after SIGKILL: reported as no exit
    text = bytes(output).decode(errors="replace")
    if overflowed:
        return ProcResult(args, proc.returncode, text, overflowed=True)
    return ProcResult(args, proc.returncode if in_time else None, text)


def _collect(proc: subprocess.Popen, deadline: float, max_output: int) -> tuple[bytearray, bool, bool]:
    """Read the output until EOF (True), the deadline (False) or more than ``max_output`` bytes."""
    fd = proc.stdout.fileno()  # type: ignore[union-attr]
    out = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return out, False, False
            if sel.select(min(left, 0.1)):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return out, False, True
                room = max_output - len(out)
                out += chunk[:room]
                if len(chunk) > room:
                    return out, True, True
            elif _exited_by(proc.pid, None):
                _kill_group(proc.pid)  # it is done: children still holding the pipe go with it


def _exited_by(pid: int, deadline: float | None) -> bool:
    """Whether ``pid`` has exited (by ``deadline``, polling; None: now), without reaping it."""
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if deadline is None or time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
