"""The node task's side of warm workers (``slurmft.launch.warm``): start this node's server, mark
the node stopping, stop the server.

``start_server`` makes the server's directory (``ownedtmp``: 0700, in ``$TMPDIR`` when a Unix
socket's path fits there, else ``/tmp``; held by the task's ``flock`` while it lives) and starts
``python -m slurmft.launch.warm --socket DIR/s``; ``stop_server`` TERMs the server, waits for
it, and removes the directory. A task killed -9 (a fenced node's step KILL, KillWait's KILL after
a TERM, the OOM killer) never stops its server: its directory stays until the next server
started on the node as the same user (``ownedtmp.make``'s sweep). A server draining its workers
after a TERM (its listening socket closed) keeps its directory: its task still holds the lock.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Mapping, NamedTuple

from slurmft.launch import ownedtmp
from slurmft.launch import warmclient as proto
from slurmft.launch.warm import settings

_SUN_PATH_MAX = 108   # bytes, the terminating NUL included
DIR_PREFIX = "slurmft-warm-"
SOCKET_NAME = "s"
# "/" + the directory's name (prefix, host tag, "-", mkdtemp's 8) + "/" + the socket's + NUL
_NAME_ROOM = 1 + len(DIR_PREFIX) + 8 + 1 + 8 + 1 + len(SOCKET_NAME) + 1


class NodeServer(NamedTuple):
    proc: subprocess.Popen
    path: str                # its socket (``SLURMFT_WARM_SOCKET``)
    lock_fd: int | None      # the task's hold on its directory (``ownedtmp``)


def start_server(env: Mapping[str, str], python: str = sys.executable) -> NodeServer:
    """Start this node's server."""
    base = env.get("TMPDIR") or "/tmp"
    if len(base.encode()) + _NAME_ROOM > _SUN_PATH_MAX or not os.path.isdir(base):
        base = "/tmp"
    sock_dir, lock_fd = ownedtmp.make(DIR_PREFIX, base)
    path = os.path.join(sock_dir, SOCKET_NAME)
    _, imports = settings(env)
    try:
        proc = subprocess.Popen([python, "-m", "slurmft.launch.warm", "--socket", path,
                                 "--imports", ",".join(imports)], env=dict(env))
    except BaseException:
        ownedtmp.release(sock_dir, lock_fd)
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


def stop_server(proc: subprocess.Popen, path: str, lock_fd: int | None = None,
                timeout_s: float = 10.0) -> None:
    """TERM the server, wait for it (KILL it after ``timeout_s``), and remove its directory,
    then let go of the task's hold on it (``lock_fd``: None where ``ownedtmp`` had no ``flock``,
    or for a directory the caller made)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    ownedtmp.release(os.path.dirname(path), lock_fd)
