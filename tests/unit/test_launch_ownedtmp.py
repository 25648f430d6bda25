"""Temporary directories held for a process's lifetime (slurmft.launch.ownedtmp): real processes
holding real ``flock``s, one killed -9 as a node's step KILL kills an agent."""

from __future__ import annotations

import os
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
LATER = time.time() + 2 * ownedtmp.MIN_AGE_S


def _age(path: Path) -> None:
    old = time.time() - 2 * ownedtmp.MIN_AGE_S
    os.utime(path, (old, old))

HOLDER = textwrap.dedent("""
    import sys, time
    from slurmft.launch import ownedtmp
    path, fd = ownedtmp.make(sys.argv[1], sys.argv[2])
    print(path, flush=True)
    time.sleep(300)
""")


def _holder(base: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, PREFIX, str(base)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    assert line, "the holder did not make its directory"
    return proc, Path(line.strip())


def test_a_live_holders_directory_stays_and_a_killed_ones_goes(tmp_path):
    live, live_dir = _holder(tmp_path)
    killed, killed_dir = _holder(tmp_path)
    try:
        (killed_dir / "attempt_0").mkdir()   # what torchrun writes in it
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        # a directory made moments ago is never judged (its maker may not hold its lock yet)
        assert ownedtmp.sweep(PREFIX, str(tmp_path)) == []
        assert ownedtmp.sweep(PREFIX, str(tmp_path), now=LATER) == [str(killed_dir)]
        assert not killed_dir.exists() and live_dir.is_dir()
        # the next one made sweeps first, and keeps the live one's, however old
        _age(live_dir)
        path, fd = ownedtmp.make(PREFIX, str(tmp_path))
        assert sorted(tmp_path.iterdir()) == sorted([live_dir, Path(path)])
        ownedtmp.release(path, fd)
        assert not Path(path).exists()
    finally:
        live.kill()
        live.wait(timeout=30)
    wait_until("the ended holder's lock to be let go",
               lambda: ownedtmp.sweep(PREFIX, str(tmp_path)) == [str(live_dir)], 30)


def test_a_directory_without_its_lock_goes_only_once_old(tmp_path):
    young = tmp_path / f"{PREFIX}young"
    young.mkdir()
    assert ownedtmp.sweep(PREFIX, str(tmp_path)) == []
    _age(young)
    assert ownedtmp.sweep(PREFIX, str(tmp_path)) == [str(young)]


def test_what_is_not_this_users_own_directory_is_left_alone(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ownedtmp.LOCK_NAME).write_text("")
    (tmp_path / f"{PREFIX}link").symlink_to(outside)
    (tmp_path / f"{PREFIX}file").write_text("")
    other = tmp_path / "other-prefix"
    other.mkdir()
    (other / ownedtmp.LOCK_NAME).write_text("")
    for path in tmp_path.iterdir():
        os.utime(path, (0, 0), follow_symlinks=False)
    assert ownedtmp.sweep(PREFIX, str(tmp_path)) == []
    assert ownedtmp.sweep(PREFIX, str(tmp_path / "missing")) == []
    assert (outside / ownedtmp.LOCK_NAME).exists() and other.is_dir()
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    theirs = tmp_path / f"{PREFIX}theirs"
    theirs.mkdir()
    (theirs / ownedtmp.LOCK_NAME).write_text("")
    os.chown(theirs, 65534, 65534)
    _age(theirs)
    assert ownedtmp.sweep(PREFIX, str(tmp_path)) == []
    assert theirs.is_dir()
