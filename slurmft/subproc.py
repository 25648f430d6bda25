"""A child process with a bound on every wait, the kill and the reap included.

``subprocess.run(timeout=...)`` kills only the child when the time is up and then waits, with no
bound, for it to die and for every process holding its pipes to close them: a grandchild left
holding stdout (``sh -c 'slow & slow'``), or a child blocked in the kernel on a hung mount, keeps
the caller waiting forever. Here the child leads its own session, the whole group is killed, and
what is still stuck after ``reap_s`` is abandoned (its output with it) rather than waited for.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

REAP_S = 5.0  # after the KILL: how long a killed group is waited for


@dataclass(frozen=True)
class Finished:
    returncode: int | None  # None: killed after the timeout
    stdout: bytes
    stderr: bytes

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_bounded(argv: Sequence[str], timeout: float, *, env: Mapping[str, str] | None = None,
                reap_s: float = REAP_S, cwd: str | None = None) -> Finished:
    """Run ``argv`` (no shell, stdin from /dev/null) for at most ``timeout`` + ``reap_s`` seconds.

    Raises ``OSError`` (``FileNotFoundError``...) when it cannot be started.
    """
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=None if env is None else dict(env),
                            start_new_session=True, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
        return Finished(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        pass
    except BaseException:  # KeyboardInterrupt...: the group must not outlive us
        _kill_group(proc.pid)
        raise
    _kill_group(proc.pid)
    try:
        out, err = proc.communicate(timeout=reap_s)
    except subprocess.TimeoutExpired:  # unkillable, or a pipe held outside the group
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        out, err = b"", b""
    return Finished(None, out or b"", err or b"")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)  # not reaped yet: the group id is still ours
    except ProcessLookupError:
        pass
