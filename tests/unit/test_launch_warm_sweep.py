"""A warm server's directory left by a task killed -9 is removed by the next server started on
the node (``warmtask.sweep_stale``): real Unix sockets, one listened on, one not."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from slurmft.launch import warmclient, warmtask

OLD = time.time() - 2 * warmtask.STALE_AFTER_S


def _server_dir(base: Path, name: str, *, listening: bool, bound_at: float = OLD,
                stopping: bool = False) -> tuple[Path, socket.socket]:
    d = base / f"{warmtask.DIR_PREFIX}{name}"
    d.mkdir(mode=0o700)
    path = d / warmtask.SOCKET_NAME
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listening:
        sock.listen(4)
    else:
        sock.close()    # the file stays, as a killed server's does
    os.utime(path, (bound_at, bound_at), follow_symlinks=False)
    if stopping:
        Path(warmclient.stopping_marker(str(path))).touch()
    return d, sock


def test_a_dead_servers_directory_goes_and_a_live_ones_stays(tmp_path):
    dead, _ = _server_dir(tmp_path, "dead", listening=False, stopping=True)
    live, sock = _server_dir(tmp_path, "live", listening=True)
    try:
        assert warmtask.sweep_stale(str(tmp_path)) == [str(dead)]
        assert not dead.exists()
        assert (live / warmtask.SOCKET_NAME).exists()
        # The probe the live server got is a connection closed before any byte: not a request.
        conn, _ = sock.accept()
        conn.settimeout(5)
        try:
            warmclient.recv_request(conn)
        except warmclient.ClosedUnasked:
            pass
        else:
            raise AssertionError("the probe sent a request")
        finally:
            conn.close()
    finally:
        sock.close()


def test_a_socket_bound_moments_ago_is_never_judged(tmp_path):
    # a server between its bind and its listen refuses connections too
    fresh, _ = _server_dir(tmp_path, "fresh", listening=False, bound_at=time.time())
    assert warmtask.sweep_stale(str(tmp_path)) == []
    assert (fresh / warmtask.SOCKET_NAME).exists()
    assert warmtask.sweep_stale(str(tmp_path), now=time.time() + 2 * warmtask.STALE_AFTER_S) == [
        str(fresh)]


def test_anything_but_a_dead_servers_own_directory_is_left_alone(tmp_path):
    unbound = tmp_path / f"{warmtask.DIR_PREFIX}nosocket"   # a task killed before its server bound
    unbound.mkdir()
    crowded, _ = _server_dir(tmp_path, "crowded", listening=False)
    (crowded / "other").write_text("not ours to remove")
    plain = tmp_path / f"{warmtask.DIR_PREFIX}file"
    plain.write_text("")
    target, _ = _server_dir(tmp_path, "dead", listening=False)
    link = tmp_path / f"{warmtask.DIR_PREFIX}link"
    outside = tmp_path / "outside"
    outside.mkdir()
    link.symlink_to(outside)
    (outside / warmtask.SOCKET_NAME).write_text("")
    removed = warmtask.sweep_stale(str(tmp_path))
    assert removed == [str(target)]
    assert unbound.is_dir() and plain.is_file() and link.is_symlink()
    assert (outside / warmtask.SOCKET_NAME).is_file()
    assert (crowded / warmtask.SOCKET_NAME).exists() and (crowded / "other").exists()


def test_a_base_that_cannot_be_listed_removes_nothing(tmp_path):
    assert warmtask.sweep_stale(str(tmp_path / "missing")) == []


def test_another_users_dead_server_is_left_alone(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    theirs, _ = _server_dir(tmp_path, "theirs", listening=False)
    os.chown(theirs / warmtask.SOCKET_NAME, 65534, 65534, follow_symlinks=False)
    os.chown(theirs, 65534, 65534)
    assert warmtask.sweep_stale(str(tmp_path)) == []
    assert (theirs / warmtask.SOCKET_NAME).exists()


def test_a_node_task_starting_its_server_sweeps_first():
    # a base short enough for a socket path (pytest's tmp_path under xdist is not: the task would
    # fall back to /tmp, as it does for any $TMPDIR too long for one)
    base = Path(tempfile.mkdtemp(prefix="sft-", dir="/tmp"))
    try:
        dead, _ = _server_dir(base, "dead", listening=False)
        # /bin/true stands for the server's interpreter: what is tested is the task's side
        proc, path = warmtask.start_server({**os.environ, "TMPDIR": str(base)}, python="/bin/true")
        try:
            assert not dead.exists()
            assert Path(path).parent.parent == base
        finally:
            warmtask.stop_server(proc, path)
        assert not Path(path).parent.exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)
