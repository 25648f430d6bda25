"""The process table, read from /proc: process identity, ancestry, environment, and killing.

A pid alone is not an identity (pids are reused), so a started daemon is recorded as
``(pid, start_time)`` where ``start_time`` is field 22 of ``/proc/<pid>/stat`` (clock ticks since
boot); every check and every kill compares both. A zombie counts as gone: it holds no resources
and only its parent (possibly a process that already exited) can reap it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Iterable

PROC = "/proc"


@dataclass(frozen=True)
class ProcId:
    """A process identity that survives pid reuse."""

    pid: int
    start_time: int

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start_time": self.start_time}

    @classmethod
    def from_json(cls, data: dict[str, int]) -> "ProcId":
        return cls(int(data["pid"]), int(data["start_time"]))


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    state: str
    start_time: int


def read_stat(pid: int) -> ProcStat | None:
    """Parse /proc/<pid>/stat, or None when the process does not exist."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after the LAST ')'.
    rest = raw[raw.rindex(")") + 2:].split()
    return ProcStat(pid=pid, state=rest[0], ppid=int(rest[1]), start_time=int(rest[19]))


def identify(pid: int) -> ProcId | None:
    stat = read_stat(pid)
    return None if stat is None else ProcId(pid, stat.start_time)


def is_alive(proc: ProcId) -> bool:
    """True while this very process (same pid AND start time) exists and is not a zombie."""
    stat = read_stat(proc.pid)
    return stat is not None and stat.start_time == proc.start_time and stat.state not in ("Z", "X")


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir(PROC) if name.isdigit()]


def read_environ(pid: int) -> dict[str, str]:
    """A process's initial environment; empty when unreadable (gone, kernel thread, zombie)."""
    try:
        with open(f"{PROC}/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def descendants(roots: Iterable[int], stats: Iterable[ProcStat]) -> set[int]:
    """Every pid below ``roots`` in the parent tree (roots excluded), from one table snapshot."""
    children: dict[int, list[int]] = {}
    for st in stats:
        children.setdefault(st.ppid, []).append(st.pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def snapshot() -> list[ProcStat]:
    """One pass over the process table (processes that vanish meanwhile are skipped)."""
    stats = []
    for pid in all_pids():
        st = read_stat(pid)
        if st is not None:
            stats.append(st)
    return stats


def send(proc: ProcId, sig: int) -> bool:
    """Signal ``proc`` if it is still that process; False when it is already gone."""
    if not is_alive(proc):
        return False
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


# Exit statuses of our own children, by identity, as reaped: whoever reaps first (a liveness
# check) must not lose what a later error message needs (how a restarted slurmd ended).
_EXITS: dict[ProcId, int] = {}


def reap_if_child(pid: int) -> None:
    """Collect the exit status of our own child so it does not linger as a zombie."""
    zombie = identify(pid)  # a zombie's stat is readable until it is reaped
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return
    if done == pid and zombie is not None:
        _EXITS[zombie] = os.waitstatus_to_exitcode(status)


def exit_code(proc: ProcId) -> int | None:
    """How our child ``proc`` ended (negative: killed by that signal), if we reaped it."""
    reap_if_child(proc.pid)
    return _EXITS.get(proc)


STATE_WORDS = {"R": "running", "S": "sleeping", "D": "uninterruptible wait", "T": "stopped",
               "t": "stopped by a tracer", "Z": "zombie", "X": "dead", "I": "idle"}


def is_stopped(proc: ProcId) -> bool:
    """True while ``proc`` exists and is stopped (SIGSTOP, or a tracer): it answers nothing."""
    stat = read_stat(proc.pid)
    return stat is not None and stat.start_time == proc.start_time and stat.state in ("T", "t")


def describe(proc: ProcId) -> str:
    """``proc`` for an error message: gone (with its exit status if it was our child), or its
    state in words and the kernel function it waits in (``/proc/<pid>/wchan``)."""
    stat = read_stat(proc.pid)
    if stat is None or stat.start_time != proc.start_time or stat.state in ("Z", "X"):
        code = exit_code(proc)
        if code is None:
            return f"pid {proc.pid} gone"
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return f"pid {proc.pid} gone ({how})"
    text = f"pid {proc.pid} {STATE_WORDS.get(stat.state, stat.state)} ({stat.state})"
    try:
        with open(f"{PROC}/{proc.pid}/wchan") as fh:
            wchan = fh.read().strip()
    except OSError:
        wchan = ""
    if wchan and wchan != "0":
        text += f" in {wchan}"
    return f"{text}, parent {stat.ppid}"


def wait_gone(procs: Iterable[ProcId], timeout: float) -> list[ProcId]:
    """Wait up to ``timeout`` s for every process to be gone; return those still alive."""
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        for proc in pending:
            reap_if_child(proc.pid)
        pending = [p for p in pending if is_alive(p)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.05)


def terminate(procs: Iterable[ProcId], grace: float) -> list[ProcId]:
    """SIGTERM, wait ``grace`` s, then SIGKILL what is left; return what survived even that."""
    procs = [p for p in procs if send(p, signal.SIGTERM)]
    left = wait_gone(procs, grace)
    for proc in left:
        send(proc, signal.SIGKILL)
    return wait_gone(left, 5.0)
