"""The node task's side of warm workers (``slurmft.launch.warm``): the server's directory, the
node marked stopping.

``make_dir`` makes the server's directory (``ownedtmp``: 0700, in ``$TMPDIR`` when a Unix
socket's path fits there, else ``/tmp``; held by the task's ``flock`` while it lives); the task
passes the socket's path to torchrun's agent, which forks the server (``warmfork``) and stops
it at its end; ``release`` then removes the directory. ``start_server``/``stop_server`` start
and stop one as a process of its own (the tests, the benchmarks). A task killed -9 (a fenced
node's step KILL, KillWait's KILL after a TERM, the OOM killer) never removes the directory: it
stays until the next server's is made on the node as the same user (``ownedtmp.make``'s sweep).
The task removes the directory once torchrun's agent has ended: a server still draining its
workers then (its agent killed) keeps serving them over their open connections; only a new
client could not reach it, and none comes (torchrun is gone).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Mapping, NamedTuple

from slurmft.launch import ownedtmp
from slurmft.launch import warmclient as proto
from slurmft.launch import warm

_SUN_PATH_MAX = 108   # bytes, the terminating NUL included
DIR_PREFIX = "slurmft-warm-"
SOCKET_NAME = "s"
# "/" + the directory's name (prefix, host tag, "-", mkdtemp's 8) + "/" + the socket's while
# it is bound (``warm.listen``) + NUL
_NAME_ROOM = 1 + len(DIR_PREFIX) + 8 + 1 + 8 + 1 + len(SOCKET_NAME + warm.STAGING_SUFFIX) + 1


class NodeServer(NamedTuple):
    proc: subprocess.Popen
    path: str                # its socket (``SLURMFT_WARM_SOCKET``)
    lock_fd: int | None      # the task's hold on its directory (``ownedtmp``)


def make_dir(env: Mapping[str, str]) -> tuple[str, int | None]:
    """This node's server's directory and the task's hold on it: (the socket's path, the lock's
    fd). The server itself is forked from torchrun's agent (``warmfork``: ``SERVE_ENV``)."""
    base = env.get("TMPDIR") or "/tmp"
    if len(base.encode()) + _NAME_ROOM > _SUN_PATH_MAX or not os.path.isdir(base):
        base = "/tmp"
    sock_dir, lock_fd = ownedtmp.make(DIR_PREFIX, base)
    return os.path.join(sock_dir, SOCKET_NAME), lock_fd


def release(path: str, lock_fd: int | None) -> None:
    """Remove the server's directory (its agent has stopped it) and let go of the hold on it."""
    ownedtmp.release(os.path.dirname(path), lock_fd)


def start_server(env: Mapping[str, str], python: str = sys.executable) -> NodeServer:
    """Start a server as a process of its own in a new directory (the tests, the benchmarks)."""
    path, lock_fd = make_dir(env)
    _, imports = warm.settings(env)
    try:
        proc = subprocess.Popen(warm.server_argv(path, imports, python), env=dict(env))
    except BaseException:
        release(path, lock_fd)
        raise
    return NodeServer(proc, path, lock_fd)


def mark_stopping(path: str) -> None:
    """Say this node's torchrun is being stopped for real (the task passes a TERM or INT on):
    its clients then leave their workers to torchrun's own bound (``warmclient.StopWatch``).
    An empty file in the server's private directory; a failure to create it is said, not raised
    (the task's signal handler calls this: the stop itself must go on)."""
    try:
        os.close(os.open(proto.stopping_marker(path), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW,
                         0o600))
    except OSError as exc:
        print(f"slurmft.launch.warm: cannot mark the node stopping: {exc}", file=sys.stderr,
              flush=True)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """TERM a server started as a process of its own, wait ``timeout_s`` for it (it waits for
    its workers), then KILL it and wait as long again; never raises."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:   # blocked in the kernel: not waited on
                print(f"slurmft.launch.warm: server {proc.pid} did not end after its KILL",
                      file=sys.stderr, flush=True)


def stop_server(proc: subprocess.Popen, path: str, lock_fd: int | None = None,
                timeout_s: float = 10.0) -> None:
    """Stop the server (``stop_process``) and remove its directory, then let go of the hold on
    it (``lock_fd``: None where ``ownedtmp`` had no ``flock``, or for a directory the caller
    made)."""
    stop_process(proc, timeout_s)
    ownedtmp.release(os.path.dirname(path), lock_fd)
