"""Run one external program for a health source: argv list, validated, always with a timeout.

Health sources (dcgmi, site scripts) are not Slurm commands; they are run here and nowhere else
in ``slurmft.health``. Each program runs under its own reaper (``reaper.py``, a child
subreaper in its own session), which owns the program's whole process tree: children that
double-fork or leave the session with ``setsid`` stay in it, and all of them are killed and
reaped when the program exits, overruns its ``timeout_s`` (the reaper is told to stop), or
prints more than ``MAX_OUTPUT_BYTES`` (a check printing without end must not grow the root
sweep's memory). A program is judged when it exits, which the reaper reports on a status pipe
at once: a descendant still holding the output pipe can neither stretch its timeout nor turn
its exit into a timeout, and none outlives it.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

MAX_OUTPUT_BYTES = 1 << 20
REAP_S = 10.0  # how long a stopped reaper is waited for (a check stuck in the kernel cannot die)
DRAIN_S = 2.0  # after the program exited: how long its last output is read while the tree dies
REAPER = Path(__file__).with_name("reaper.py")


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


class _Watch:
    """The output and status pipes of one reaper, read together until the program is judged."""

    def __init__(self, out_fd: int, status_fd: int, max_output: int) -> None:
        self.out_fd, self.status_fd, self.max_output = out_fd, status_fd, max_output
        self.output = bytearray()
        self.status = b""
        self.overflowed = self.out_eof = False

    @property
    def exited(self) -> bool:  # the reaper's first line says how the program ended
        return b"\n" in self.status

    def pump(self, until: float, stop_when_exited: bool) -> None:
        """Read both pipes until ``until``, the output's EOF, an overflow, or (if asked) the exit."""
        with selectors.DefaultSelector() as sel:
            if not self.out_eof:
                sel.register(self.out_fd, selectors.EVENT_READ)
            if not self.exited:
                sel.register(self.status_fd, selectors.EVENT_READ)
            while sel.get_map() and not self.overflowed:
                if stop_when_exited and self.exited:
                    return
                left = until - time.monotonic()
                if left <= 0:
                    return
                for key, _ in sel.select(min(left, 0.5)):
                    chunk = os.read(key.fd, 1 << 16)
                    if key.fd == self.status_fd:
                        self.status += chunk[:4096]
                        if not chunk or self.exited:
                            sel.unregister(key.fd)
                        continue
                    if not chunk:
                        self.out_eof = True
                        sel.unregister(key.fd)
                        continue
                    room = self.max_output - len(self.output)
                    self.output += chunk[:room]
                    self.overflowed = len(chunk) > room


def _returncode(status: bytes, program: str) -> int | None:
    """The program's exit from the reaper's first status line; raises OSError if it never ran."""
    first = status.split(b"\n", 1)[0].decode(errors="replace").split(" ", 2)
    if first[0] == "exit":
        return int(first[1])
    if first[0] == "signal":
        return -int(first[1])
    if first[0] == "error":
        raise OSError(int(first[1]), first[2] if len(first) > 2 else "cannot start", program)
    return None


def run(argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None,
        max_output: int = MAX_OUTPUT_BYTES) -> ProcResult:
    """Run ``argv`` (no shell) with stdin closed, under its own reaper; see the module doc.
    Raises OSError (FileNotFoundError...) when the program cannot be started."""
    args = validate_argv(argv, "argv")
    status_r, status_w = os.pipe()
    try:
        reaper = subprocess.Popen(
            [sys.executable, "-I", "-S", str(REAPER), str(status_w), "--", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, pass_fds=(status_w,),
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    watch = _Watch(reaper.stdout.fileno(), status_r, max_output)  # type: ignore[union-attr]
    try:
        watch.pump(time.monotonic() + timeout_s, stop_when_exited=True)
        if watch.exited and not watch.overflowed:  # the tree is dying: read what it left
            watch.pump(time.monotonic() + DRAIN_S, stop_when_exited=False)
    finally:
        _stop(reaper)
        reaper.stdout.close()  # type: ignore[union-attr]
        os.close(status_r)
    text = bytes(watch.output).decode(errors="replace")
    code = _returncode(watch.status, args[0]) if watch.exited else None
    return ProcResult(args, code, text, overflowed=watch.overflowed)


def _stop(reaper: subprocess.Popen) -> None:
    """End the reaper: it kills the program's tree on SIGTERM; SIGKILL its group if it hangs."""
    if reaper.poll() is None:
        try:
            reaper.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            reaper.wait(timeout=REAP_S)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(reaper.pid, signal.SIGKILL)  # not reaped yet: the group id is still ours
        except (ProcessLookupError, PermissionError):
            pass
        try:
            reaper.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            pass  # blocked in the kernel even after SIGKILL: reported as no exit
