"""The reaper between the sweep and one check program: it owns the check's whole process tree.

Run as ``python -I -S reaper.py STATUS_FD -- ARGV...`` by ``slurmft.health.proc`` (standard
library only: it is started as a file, not imported). It makes itself a child subreaper
(``prctl(PR_SET_CHILD_SUBREAPER)``), so a descendant that is orphaned (a double fork, a
``setsid`` daemon) is re-parented to it rather than to init and stays in its tree; it starts
the check with stdin closed and its output on the reaper's own stdout. When the check exits it
writes ``exit N`` or ``signal N`` to STATUS_FD at once (the sweep judges the check then, not
when its last descendant closes the output), then kills every descendant still alive (walking
``/proc``, signalling through a pidfd so that a reused pid is never hit) and reaps them. On
SIGTERM (the sweep's timeout) or its parent's death it does the same to the check itself first.

Status lines: ``exit N``, ``signal N``, ``error ERRNO TEXT`` (the check could not be started),
``killed`` (stopped by the sweep), then ``left N`` if N descendants could not be killed within
``KILL_S`` (blocked in the kernel). This file is the only place slurmft makes a subreaper.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
KILL_S = 10.0  # how long descendants are killed and reaped for (one stuck in the kernel cannot die)


class Stop(Exception):
    """SIGTERM from the sweep (the check overran), or the sweep died (PDEATHSIG)."""


def _quiet() -> None:
    """From here on the cleanup is not cut short (a pending signal is dropped, not raised)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _stop(_signum: int, _frame: object) -> None:
    _quiet()
    raise Stop


def _ppids() -> dict[int, int]:
    """pid -> parent pid of every process, from /proc (a process gone meanwhile is left out)."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        out[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
    return out


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in _ppids().items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def _kill(pid: int, tree: set[int]) -> None:
    """SIGKILL ``pid`` if it is still a member of ``tree``: the pidfd pins the process, and its
    parent, read after the pidfd was opened, shows the pid was not reused by a stranger."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if _parent_of(pid) in tree:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(me: int) -> int:
    """Kill and reap every descendant of ``me``; how many were still there after ``KILL_S``."""
    deadline = time.monotonic() + KILL_S
    while True:
        alive = descendants(me)
        if not alive:
            return 0
        tree = alive | {me}
        for pid in alive:
            _kill(pid, tree)
        _reap()
        if time.monotonic() >= deadline:
            return len(descendants(me))
        time.sleep(0.005)


def _status(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit {code}"


def main(argv: list[str]) -> int:
    status_fd, argv = int(argv[1]), argv[3:]
    me = os.getpid()
    with os.fdopen(status_fd, "w", buffering=1) as status:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            status.write(f"error {ctypes.get_errno()} cannot become a child subreaper\n")
            return 127
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGHUP, _stop)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        try:
            if os.getppid() == 1:  # the sweep died before the line above: never start the check
                raise Stop
            try:
                check = subprocess.Popen(argv, stdin=subprocess.DEVNULL, close_fds=True)
            except OSError as exc:
                status.write(f"error {exc.errno or 0} {exc.strerror or exc}\n")
                return 127
            code = check.wait()
            _quiet()
            status.write(_status(code) + "\n")  # judged now; its descendants die next
        except Stop:
            status.write("killed\n")
        left = kill_tree(me)
        if left:
            status.write(f"left {left}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
