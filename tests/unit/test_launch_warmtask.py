"""A warm server's directory (slurmft.launch.warmtask, ownedtmp): held by its node's task, so a
server that stopped listening (it drains its workers after a TERM, or it is gone) keeps it while
the task lives, and the next server started on the node removes the one a killed task left.
Real processes; ``/bin/true`` stands for the server's interpreter (what is tested is the task's
side)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from slurmft.launch import ownedtmp, warmtask

TASK = textwrap.dedent("""
    import os, sys, time
    from slurmft.launch import warmtask
    server = warmtask.start_server({**os.environ, "TMPDIR": sys.argv[1]}, python="/bin/true")
    print(server.path, flush=True)
    time.sleep(300)
""")


@pytest.fixture
def base():
    # short enough for a socket's path (pytest's tmp_path under xdist may not be: the task would
    # fall back to /tmp, as it does for any $TMPDIR too long for one)
    path = Path(tempfile.mkdtemp(prefix="sft-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _age(path: Path) -> None:
    old = time.time() - 2 * ownedtmp.MIN_AGE_S
    os.utime(path, (old, old))


def test_a_killed_tasks_directory_is_removed_by_the_next_server_and_a_live_ones_kept(base):
    killed = subprocess.Popen([sys.executable, "-c", TASK, str(base)], stdout=subprocess.PIPE,
                              text=True)
    try:
        line = killed.stdout.readline() if killed.stdout else ""
        assert line, "the task did not start its server"
        left = Path(line.strip()).parent
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
    live = warmtask.start_server({**os.environ, "TMPDIR": str(base)}, python="/bin/true")
    try:
        live.proc.wait(timeout=60)    # its server is gone: nobody listens on its socket
        assert Path(live.path).parent.parent == base
        _age(left)
        _age(Path(live.path).parent)
        assert left.is_dir()
        nxt = warmtask.start_server({**os.environ, "TMPDIR": str(base)}, python="/bin/true")
        warmtask.stop_server(*nxt)
        assert not left.exists(), "the killed task's directory was left"
        assert Path(live.path).parent.is_dir(), "a live task's directory was taken"
        assert not Path(nxt.path).parent.exists()
    finally:
        warmtask.stop_server(*live)
    assert not Path(live.path).parent.exists()
    assert list(base.iterdir()) == []


def test_a_tmpdir_too_long_for_a_socket_path_falls_back_to_tmp(tmp_path):
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    server = warmtask.start_server({**os.environ, "TMPDIR": str(deep)}, python="/bin/true")
    try:
        assert Path(server.path).parent.parent == Path("/tmp")
        assert len(server.path.encode()) < 108
    finally:
        warmtask.stop_server(*server)
    assert not Path(server.path).parent.exists()
