"""The node task's side of warm workers (``slurmft.launch.warm``): start this node's server, mark
the node stopping, stop the server, and remove the directories of servers a killed task left.

``start_server`` makes a 0700 directory (``mkdtemp`` in ``$TMPDIR``, else ``/tmp``: a Unix
socket's path must fit 108 bytes) and starts ``python -m slurmft.launch.warm --socket DIR/s``;
``stop_server`` TERMs it, waits, and removes the directory. A task killed -9 (a fenced node's
step KILL, KillWait's KILL after a TERM, the OOM killer) never stops its server: its directory
stays, and the next server started on the node as the same user removes it (``sweep_stale``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from typing import Mapping

from slurmft.launch import warmclient as proto
from slurmft.launch.warm import settings

_SOCK_PATH_MAX = 100   # sun_path is 108 bytes
DIR_PREFIX = "slurmft-warm-"
SOCKET_NAME = "s"
STALE_AFTER_S = 60.0
PROBE_S = 1.0


def start_server(env: Mapping[str, str], python: str = sys.executable
                 ) -> tuple[subprocess.Popen, str]:
    """Start this node's server; returns it and its socket path (for ``SLURMFT_WARM_SOCKET``)."""
    base = env.get("TMPDIR") or "/tmp"
    if len(base) > _SOCK_PATH_MAX - 30 or not os.path.isdir(base):
        base = "/tmp"
    sweep_stale(base)
    sock_dir = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=base)   # 0700
    path = os.path.join(sock_dir, SOCKET_NAME)
    _, imports = settings(env)
    proc = subprocess.Popen([python, "-m", "slurmft.launch.warm", "--socket", path,
                             "--imports", ",".join(imports)], env=dict(env))
    return proc, path


def sweep_stale(base: str, now: float | None = None) -> list[str]:
    """Remove this uid's server directories in ``base`` that no server serves any more, and
    return them: a task killed -9 (a fenced node's step, KillWait's KILL after a TERM, the OOM
    killer) never ran ``stop_server``, and its directory stayed. Stale: the socket refuses a
    connection (nobody listens on it, whatever the namespaces; a live server takes the probe
    for a client that closed before its request and says nothing) and was bound over
    ``STALE_AFTER_S`` ago (a server binds, then listens: never judged between the two). A
    directory without a socket, of another uid, or holding anything else is left alone;
    nothing here raises."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(DIR_PREFIX)]
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        path = os.path.join(entry.path, SOCKET_NAME)
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(
                    follow_symlinks=False).st_uid != uid:
                continue
            st = os.lstat(path)
            if (not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid
                    or now - st.st_mtime < STALE_AFTER_S
                    or not set(os.listdir(entry.path)) <= {SOCKET_NAME, proto.STOPPING_NAME}
                    or _listened_on(path)):
                continue
            for leftover in (path, proto.stopping_marker(path)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            os.rmdir(entry.path)
        except OSError:
            continue
        removed.append(entry.path)
    return removed


def _listened_on(path: str) -> bool:
    """False only when a connection to ``path`` is refused: nobody listens on it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_S)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return False
        except OSError:   # a full backlog, a timeout, a vanished file: not proven stale
            return True
    return True


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


def stop_server(proc: subprocess.Popen, path: str, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    for leftover in (path, proto.stopping_marker(path)):
        try:
            os.unlink(leftover)
        except OSError:
            pass
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass
