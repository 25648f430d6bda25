"""One watcher per run: an exclusive ``flock`` on ``<run_dir>/watch/lock`` and, beside it, a lease
``<run_dir>/watch/lease.json`` (host, pid, a token of its own, the time it was last renewed).

``flock`` is node-local on many NFS and Lustre setups: two watchers on two login nodes would
both get it. The lease holds there: written atomically (temp, fsync, rename), its mtime set to
its time; renewed by its mtime alone (``os.utime``, while the file is the one this watcher wrote
and its recorded time under ``lease_s / 2`` old; else written again in full), every
``lease_s / 4`` by the cycle (``keep``; each renewal comes at a random point between 85 %
and all of that quarter, the first after taking it between a quarter and all of it, so that a
watcher that took a thousand runs in one cycle does not rewrite a thousand leases in one cycle
every ``lease_s / 4`` after), and
taken over only when stale: on the same host when its
process is gone (pid and its start time: a reused pid is not the watcher) or it is older than
``lease_s``, from another host only when older than ``lease_s``
(clocks of hosts differ by seconds, the lease by minutes). A watcher whose lease was taken over
(it stalled longer than ``lease_s``) finds another token at its next renewal, which comes before
any action, and lets the run go (``LeaseLost``). A watcher that cannot renew its lease acts
on no cycle once it is ``lease_s / 2`` old (``LeaseUnrenewed``), so it has stopped well before
another host may take the run over. Where ``flock`` is not supported the lease alone
holds; where the lease cannot be written either, the watcher refuses the run, saying why.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

from slurmft import numbers
from slurmft.rundir import RunDir, atomic_write_json
from slurmft.watch.runview import read_small_json

log = logging.getLogger("slurmft.watch")
LEASE_VERSION = 1
DEFAULT_LEASE_S = 300.0
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class LockError(RuntimeError):
    """The run cannot be locked: another watcher holds it, or neither lock works here."""


class LeaseLost(LockError):
    """Another watcher took the run over while this one stalled: it must not act on it."""


class LeaseUnrenewed(LockError):
    """The lease could not be renewed and is half its length old: this cycle must not act (a
    watcher on another host may take it over once it is ``lease_s`` old); tried again next cycle."""


MAX_PID = 2**22  # Linux's largest pid_max; os.kill of a pid past a C int raises OverflowError


@dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    token: str
    time: float
    started: int | None = None  # the pid's start time (/proc, clock ticks): a reused pid is not it

    def describe(self, now: float) -> str:
        return f"pid {self.pid} on {self.host} (lease renewed {max(now - self.time, 0):.0f} s ago)"


def read_lease(path) -> Lease | None:
    """The lease at ``path``; None when absent or not a lease (a file we never wrote is no
    claim on the run: it is replaced)."""
    data: Any = read_small_json(path)
    if not isinstance(data, dict) or data.get("version") != LEASE_VERSION:
        return None
    host, token = data.get("host"), data.get("token")
    pid = numbers.whole(data.get("pid"), 1, MAX_PID)  # a pid os.kill can be asked about
    when = numbers.unix_time(data.get("time"))
    started = data.get("started")
    if not (isinstance(host, str) and isinstance(token, str) and pid is not None and when is not None):
        return None
    if started is not None and numbers.count(started) is None:
        return None
    try:  # renewed by its mtime since it was written (RunLock.keep)
        touched = numbers.unix_time(os.lstat(path).st_mtime)
    except OSError:
        touched = None
    return Lease(host, pid, token, max(when, touched) if touched is not None else when, started)


def start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read(4096).decode(errors="replace")
        return int(raw[raw.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, started: int | None = None) -> bool:
    """This very process (same pid and, when known, same start time) still exists."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now_started = start_time(pid)
    return started is None or now_started is None or now_started == started


class RunLock:
    """Exclusive per-run lock: a second watcher of the same run, on this host or another one,
    refuses to start and is told who holds it."""

    def __init__(self, run_dir: RunDir, *, lease_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.time, host: str | None = None,
                 pid: int | None = None) -> None:
        self.path = run_dir.watch_state.parent / "lock"
        self.lease_path = run_dir.watch_state.parent / "lease.json"
        self.lease_s = lease_s
        self.clock = clock
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self.started = start_time(self.pid)
        self.token = secrets.token_hex(8)
        self._fd: int | None = None
        self._renewed: float | None = None
        self._due: float | None = None  # when the next renewal is due
        self._ino: int | None = None  # the lease file this watcher wrote, and when
        self._written: float | None = None

    # -- flock ------------------------------------------------------------------------------------

    def _flock(self) -> int | None:
        """The locked fd; None where flock is not supported (the lease alone then holds)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LockError(f"cannot create {self.path.parent}: {exc.strerror}") from None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            raise LockError(f"cannot open the watch lock {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                holder = os.pread(fd, 128, 0).decode(errors="replace").strip() or "unknown"
            except OSError:
                holder = "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise LockError(f"{self.path.parent.parent} is already watched by {holder}") from None
            if exc.errno in _UNSUPPORTED:
                log.warning("%s: flock is not supported here (%s): the lease alone guards the run",
                            self.path, exc.strerror)
                return None
            raise LockError(f"cannot lock {self.path}: {exc.strerror}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {self.pid} on {self.host}\n".encode(), 0)
        except OSError as exc:  # not a regular file (a FIFO planted there), or a full disk
            os.close(fd)
            raise LockError(f"cannot use the watch lock {self.path}: {exc.strerror}") from None
        return fd

    # -- the lease --------------------------------------------------------------------------------

    def _stale(self, lease: Lease, now: float) -> bool:
        if lease.host == self.host:
            return not pid_alive(lease.pid, lease.started) or now - lease.time > self.lease_s
        return now - lease.time > self.lease_s

    def _write_lease(self, now: float, *, first: bool = False) -> None:
        atomic_write_json(self.lease_path, {"version": LEASE_VERSION, "host": self.host,
                                            "pid": self.pid, "token": self.token, "time": now,
                                            "started": self.started})
        os.utime(self.lease_path, (now, now), follow_symlinks=False)  # its mtime: its renewal
        self._ino, self._written = os.lstat(self.lease_path).st_ino, now
        self._renewed_at(now, first)

    def _touch_lease(self, now: float) -> bool:
        """Renew by the lease file's mtime (one ``utime``: nothing written, nothing fsynced) while
        the file is the one this watcher wrote (the same inode: a takeover replaces it by rename)
        and its recorded time is under half a lease old (a reader that looks at the recorded time
        alone, an older slurmft, never finds it stale). False: write it in full instead."""
        if self._ino is None or self._written is None or not 0 <= now - self._written < self.lease_s / 2:
            return False
        try:
            if os.lstat(self.lease_path).st_ino != self._ino:
                return False
        except FileNotFoundError:
            return False
        os.utime(self.lease_path, (now, now), follow_symlinks=False)
        self._renewed_at(now, False)
        return True

    def _renewed_at(self, now: float, first: bool) -> None:
        self._renewed = now
        # Never later than a quarter of the lease, at a random point of that quarter's end (the
        # first one of its last three quarters): leases taken in one cycle, or all renewed in one
        # long cycle (a thousand runs taken on), drift apart instead of staying together.
        self._due = now + self.lease_s / 4 * random.uniform(0.25 if first else 0.85, 1.0)

    def acquire(self) -> None:
        fd = self._flock()
        now = self.clock()
        try:
            held = read_lease(self.lease_path)
            if held is not None and held.token != self.token and not self._stale(held, now):
                raise LockError(f"{self.path.parent.parent} is already watched by "
                                f"{held.describe(now)}")
            try:
                self._write_lease(now, first=True)
            except OSError as exc:
                why = "flock is not supported here and " if fd is None else ""
                raise LockError(f"cannot lock {self.path.parent.parent}: {why}the lease "
                                f"{self.lease_path} cannot be written ({exc.strerror or exc})") from None
            mine = read_lease(self.lease_path)
            if mine is None or mine.token != self.token:  # another host wrote it the same moment
                raise LockError(f"{self.path.parent.parent} is already watched by "
                                f"{mine.describe(now) if mine else 'another watcher'}")
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        self._fd = fd

    def keep(self, now: float | None = None) -> None:
        """Before a cycle acts on the run: renew the lease when a quarter of it has passed; raise
        LeaseLost when another watcher has taken it over meanwhile."""
        now = self.clock() if now is None else now
        if (self._renewed is not None and self._due is not None
                and 0 <= now - self._renewed and now < self._due):
            return
        try:
            if not self._touch_lease(now):
                held = read_lease(self.lease_path)
                if held is not None and held.token != self.token:
                    raise LeaseLost(f"{self.path.parent.parent}: another watcher took the run over "
                                    f"({held.describe(now)}) while this one did not renew its lease")
                self._write_lease(now)
        except OSError as exc:  # tried again next cycle
            log.error("cannot renew the watch lease %s: %s", self.lease_path, exc)
            age = None if self._renewed is None else now - self._renewed
            if age is None or not 0 <= age < self.lease_s / 2:
                raise LeaseUnrenewed(f"{self.lease_path}: not renewed for {age or 0:.0f} s "
                                     f"({exc.strerror or exc}): not acting until it is") from None

    def release(self) -> None:
        try:
            held = read_lease(self.lease_path)
            if held is not None and held.token == self.token:
                os.unlink(self.lease_path)
        except OSError:
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
