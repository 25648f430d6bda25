"""Notifications: ``slurmft watch --on-event CMD`` runs a user command for every watcher event.

``run_hook(argv, event, timeout_s)`` runs ``argv`` (a list, never through a shell; the CLI builds
it with ``shlex.split``) in its own session with the event as one JSON object on stdin, and
returns a ``HookResult``. It never raises: a hook that cannot start, fails, or overruns is
reported in the result and logged, and the watcher carries on. Time is bounded (past
``timeout_s`` the hook's whole process group is killed) and so is what is kept of its output
(the first ``MAX_OUTPUT`` bytes; the rest is read and dropped so the hook never blocks on a
full pipe). A hook that exits while a child it started still holds its stdout open is not
waited for beyond ``EXIT_DRAIN_S``; such a child is left running (it is the hook's business).
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from slurmft import numbers

log = logging.getLogger(__name__)
REAP_S = 10.0  # how long a killed hook is waited for (one stuck in the kernel cannot die)

MAX_OUTPUT = 4096
EXIT_DRAIN_S = 0.5
_CHUNK = 65536


@dataclass(frozen=True)
class HookResult:
    argv: tuple[str, ...]
    ok: bool
    returncode: int | None = None   # None: it did not start, or was killed on timeout
    timed_out: bool = False
    duration_s: float = 0.0
    output: str = ""                # stdout and stderr together, at most MAX_OUTPUT bytes
    error: str = ""                 # why it is not ok, in one line


def _encode(event: Mapping[str, Any]) -> bytes:
    # Valid JSON whatever the event holds (a non-finite float is written null, never NaN).
    return (numbers.dumps(event, sort_keys=True, default=str) + "\n").encode()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exchange(proc: subprocess.Popen, data: bytes, deadline: float) -> tuple[bytes, bool]:
    """Feed ``data`` to stdin and collect stdout until EOF, the deadline, or the hook's exit plus
    a short drain. Returns (kept output, timed out)."""
    kept = bytearray()
    sel = selectors.DefaultSelector()
    assert proc.stdin is not None and proc.stdout is not None
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdout, selectors.EVENT_READ)
    if data:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return bytes(kept), True
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > EXIT_DRAIN_S:
                break
            wait = min(deadline - now, 0.1)
            for key, _ in sel.select(wait):
                if key.fileobj is proc.stdin:
                    try:
                        written = os.write(proc.stdin.fileno(), data)
                    except (BrokenPipeError, BlockingIOError) as exc:
                        written = len(data) if isinstance(exc, BrokenPipeError) else 0
                    data = data[written:]
                    if not data:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                else:
                    chunk = os.read(proc.stdout.fileno(), _CHUNK)
                    if not chunk:
                        sel.unregister(proc.stdout)
                        continue
                    kept += chunk[:max(MAX_OUTPUT - len(kept), 0)]
        return bytes(kept), False
    finally:
        sel.close()
        for pipe in (proc.stdin, proc.stdout):
            if not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass


def run_hook(argv: Sequence[str], event: Mapping[str, Any], timeout_s: float) -> HookResult:
    """Run the hook ``argv`` with ``event`` as JSON on stdin, for at most ``timeout_s`` seconds."""
    started = time.monotonic()
    args = tuple(argv) if not isinstance(argv, (str, bytes)) else ()
    if not args or not all(isinstance(a, str) and a for a in args):
        return _done(HookResult(tuple(map(str, args)), False, error=f"hook command {argv!r} is not a "
                                "non-empty list of arguments"))
    if not timeout_s > 0:
        return _done(HookResult(args, False, error=f"hook timeout must be > 0 s, got {timeout_s!r}"))
    try:
        proc = subprocess.Popen(list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    except OSError as exc:
        return _done(HookResult(args, False, error=f"cannot run {args[0]}: {exc.strerror or exc}",
                                duration_s=time.monotonic() - started))
    deadline = started + timeout_s
    try:
        output, timed_out = _exchange(proc, _encode(event), deadline)
    except Exception as exc:  # never let a hook stop the watcher
        _kill_group(proc)
        _reap(proc)
        return _done(HookResult(args, False, error=f"hook {args[0]} failed: {exc}",
                                duration_s=time.monotonic() - started))
    if not timed_out:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        _kill_group(proc)
        _reap(proc)
        return _done(HookResult(args, False, None, True, time.monotonic() - started,
                                output.decode(errors="replace"),
                                f"hook {args[0]} did not finish within {timeout_s:g} s: killed"))
    code = proc.returncode
    why = "" if code == 0 else (f"hook {args[0]} was killed by signal {-code}" if code < 0
                                else f"hook {args[0]} exited with {code}")
    return _done(HookResult(args, code == 0, code, False, time.monotonic() - started,
                            output.decode(errors="replace"), why))


def _done(result: HookResult) -> HookResult:
    if not result.ok:
        tail = " ".join(result.output.split())[-300:]
        log.warning("on-event hook: %s%s", result.error, f" (output: {tail})" if tail else "")
    return result


def _reap(proc: subprocess.Popen) -> None:
    """Wait for a killed hook, but not for ever: one blocked in the kernel cannot die at once."""
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        log.error("hook %s (pid %d) did not die %g s after SIGKILL; not waiting for it",
                  proc.args[0] if isinstance(proc.args, list) else proc.args, proc.pid, REAP_S)
