"""Temporary directories held for a process's lifetime (slurmft.launch.ownedtmp): real processes
holding real ``flock``s, one killed -9 as a node's step KILL kills an agent."""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from procs import wait_until
from slurmft.launch import ownedtmp

PREFIX = "test-owned-"

HOLDER = textwrap.dedent("""
    import sys, time
    from slurmft.launch import ownedtmp
    path, fd = ownedtmp.make(sys.argv[1], sys.argv[2])
    print(path, flush=True)
    time.sleep(300)
""")


def _later() -> float:
    return time.time() + 2 * ownedtmp.MIN_AGE_S


def _age(path: Path) -> None:
    old = time.time() - 2 * ownedtmp.MIN_AGE_S
    os.utime(path, (old, old), follow_symlinks=False)


def _holder(base: Path, started: list[subprocess.Popen]) -> Path:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, PREFIX, str(base)],
                            stdout=subprocess.PIPE, text=True)
    started.append(proc)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    assert line, "the holder did not make its directory within 60 s"
    return Path(line.strip())


def test_a_live_holders_directory_stays_and_a_killed_ones_goes(tmp_path):
    mine = f"{PREFIX}{ownedtmp.host_tag()}-"
    started: list[subprocess.Popen] = []
    try:
        live_dir, killed_dir = _holder(tmp_path, started), _holder(tmp_path, started)
        live, killed = started
        assert live_dir.name.startswith(mine) and killed_dir.name.startswith(mine)
        (killed_dir / "attempt_0").mkdir()   # what torchrun writes in it
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        # a directory made moments ago is never judged (its maker may not hold its lock yet)
        assert ownedtmp.sweep(mine, str(tmp_path)) == []
        assert ownedtmp.sweep(mine, str(tmp_path), now=_later()) == [str(killed_dir)]
        assert not killed_dir.exists() and live_dir.is_dir()
        # the next one made sweeps first, and keeps the live one's however old
        _age(live_dir)
        path, fd = ownedtmp.make(PREFIX, str(tmp_path))
        assert sorted(tmp_path.iterdir()) == sorted([live_dir, Path(path)])
        ownedtmp.release(path, fd)
        assert not Path(path).exists()
        live.kill()
        live.wait(timeout=30)
        wait_until("the ended holder's lock to be let go",
                   lambda: ownedtmp.sweep(mine, str(tmp_path)) == [str(live_dir)], 30)
    finally:
        for proc in started:
            proc.kill()
            proc.wait(timeout=30)


def test_another_hosts_directory_is_never_judged(tmp_path):
    # a $TMPDIR shared between nodes: another node's lock may not show here
    theirs = tmp_path / f"{PREFIX}{ownedtmp.host_tag('another-node')}-abcdefgh"
    theirs.mkdir()
    (theirs / ownedtmp.LOCK_NAME).write_text("")
    _age(theirs)
    path, fd = ownedtmp.make(PREFIX, str(tmp_path))
    ownedtmp.release(path, fd)
    assert theirs.is_dir()
    assert ownedtmp.host_tag("another-node") != ownedtmp.host_tag()


def test_what_is_not_this_users_lockable_directory_is_left_alone(tmp_path):
    mine = f"{PREFIX}{ownedtmp.host_tag()}-"
    unlocked = tmp_path / f"{mine}nolock"    # no lock file: nothing says its process is gone
    unlocked.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ownedtmp.LOCK_NAME).write_text("")
    (tmp_path / f"{mine}link").symlink_to(outside)
    (tmp_path / f"{mine}file").write_text("")
    for path in tmp_path.iterdir():
        _age(path)
    assert ownedtmp.sweep(mine, str(tmp_path)) == []
    assert ownedtmp.sweep(mine, str(tmp_path / "missing")) == []
    assert unlocked.is_dir() and (outside / ownedtmp.LOCK_NAME).exists()
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    theirs = tmp_path / f"{mine}theirs"
    theirs.mkdir()
    (theirs / ownedtmp.LOCK_NAME).write_text("")
    os.chown(theirs, 65534, 65534)
    _age(theirs)
    assert ownedtmp.sweep(mine, str(tmp_path)) == []
    assert theirs.is_dir()


def test_without_flock_a_directory_is_still_made_and_removed_but_never_judged(tmp_path,
                                                                             monkeypatch):
    # stands for a filesystem without flock (Lustre mounted noflock): none here
    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    path, fd = ownedtmp.make(PREFIX, str(tmp_path))
    assert fd is None and Path(path).is_dir() and not (Path(path) / ownedtmp.LOCK_NAME).exists()
    _age(Path(path))
    monkeypatch.undo()
    assert ownedtmp.sweep(PREFIX, str(tmp_path)) == []
    ownedtmp.release(path, fd)
    assert not Path(path).exists()
