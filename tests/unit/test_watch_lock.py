"""One watcher per run on shared filesystems (``slurmft/watch/lock.py``): the lease beside flock.

Two login nodes sharing an NFS or Lustre run dir whose ``flock`` is node-local cannot be had
here: ``node_local_flock`` stands in for it (each "host" gets the flock), which is what such a
filesystem does; everything else (the lease file, its renewal, the takeover) is the real code."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import pytest

from slurmft.rundir import RunDir
from slurmft.watch import lock as lockmod
from slurmft.watch.config import WatchConfig
from slurmft.watch.lock import LeaseLost, LockError, RunLock
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import RunState

from test_watch_runwatch import NODES, RecordingClient, job


@pytest.fixture
def run(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    return rd


@pytest.fixture
def node_local_flock(monkeypatch):
    monkeypatch.setattr(lockmod.fcntl, "flock", lambda fd, op: None)


class Clock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_watcher_on_another_host_is_refused_where_flock_is_node_local(run, node_local_flock):
    """Today: both watchers get the (node-local) flock and both act on the run."""
    clock = Clock()
    first = RunLock(run, host="login1", pid=4242, clock=clock)
    first.acquire()
    clock.now += 100
    with pytest.raises(LockError, match=r"already watched by pid 4242 on login1 \(lease renewed 100 s ago\)"):
        RunLock(run, host="login2", pid=4242, clock=clock).acquire()


def test_a_stalled_watchers_lease_is_taken_over_and_it_then_never_acts(run, node_local_flock):
    clock = Clock()
    first = RunLock(run, host="login1", pid=1, clock=clock, lease_s=300)
    first.acquire()
    client = RecordingClient()
    stalled = RunWatch(run, RunState(job_id="7"), client, WatchConfig(), lock=first)
    clock.now += 301  # login1 stopped renewing (suspended, partitioned) for longer than lease_s
    RunLock(run, host="login2", pid=2, clock=clock).acquire()
    with pytest.raises(LeaseLost, match="another watcher took the run over"):
        first.keep()
    from slurmft.slurm.client import JobState
    stalled.step(job(JobState.FAILED, exit_code=1), NODES, clock.now)  # a crash it would requeue
    assert client.calls == [] and not stalled.active
    assert not run.watch_state.exists()  # and it wrote nothing


def test_a_live_lease_is_renewed_every_quarter_and_kept(run, node_local_flock):
    clock = Clock()
    held = RunLock(run, host="login1", pid=1, clock=clock, lease_s=300)
    held.acquire()
    for _ in range(10):
        clock.now += 80
        held.keep()
    with pytest.raises(LockError, match="already watched by pid 1 on login1"):
        RunLock(run, host="login2", pid=2, clock=clock).acquire()


def test_a_dead_watchers_lease_on_this_host_is_taken_over_at_once(run, node_local_flock):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    host = "login1"
    RunLock(run, host=host, pid=int(dead.stdout)).acquire()  # exited without releasing
    RunLock(run, host=host).acquire()


def test_release_hands_the_run_over_at_once(run):
    first = RunLock(run)
    first.acquire()
    first.release()
    assert not (run.root / "watch" / "lease.json").exists()
    RunLock(run, host="elsewhere").acquire()


def test_where_neither_flock_nor_the_lease_works_the_run_is_refused_saying_why(run, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    def no_write(path, obj):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(lockmod.fcntl, "flock", no_flock)
    monkeypatch.setattr(lockmod, "atomic_write_json", no_write)
    with pytest.raises(LockError, match="flock is not supported here and the lease .* cannot be "
                                        "written \\(Read-only file system\\)"):
        RunLock(run).acquire()


def test_a_lease_that_is_not_one_is_replaced(run):
    (run.root / "watch").mkdir()
    (run.root / "watch" / "lease.json").write_text(json.dumps({"version": 1, "pid": "x"}))
    RunLock(run).acquire()
    assert json.loads((run.root / "watch" / "lease.json").read_text())["pid"] > 0


def test_a_lease_whose_pid_now_belongs_to_another_process_is_taken_over(run, node_local_flock):
    """A watcher killed, its pid reused by some other process on the login node before systemd
    restarts it: the lease names the pid's start time, so the restart is not refused for 300 s."""
    import os

    stale = {"version": 1, "host": "login1", "pid": os.getpid(), "token": "dead", "time": 1_000.0,
             "started": (lockmod.start_time(os.getpid()) or 0) + 1}
    (run.root / "watch").mkdir()
    (run.root / "watch" / "lease.json").write_text(json.dumps(stale))
    RunLock(run, host="login1", pid=os.getpid() + 1, clock=Clock(1_010.0)).acquire()
    stale["started"] = lockmod.start_time(os.getpid())  # the very process: still alive, refused
    (run.root / "watch" / "lease.json").write_text(json.dumps(stale))
    with pytest.raises(LockError, match="already watched by pid"):
        RunLock(run, host="login1", pid=os.getpid() + 1, clock=Clock(1_010.0)).acquire()


def test_a_watcher_that_cannot_renew_its_lease_stops_acting_before_it_can_be_taken_over(
        run, node_local_flock, monkeypatch):
    # Its renewal failed (this host's mount went read-only, the lease file's quota) and it went
    # on acting: once its lease is lease_s old, another host's watcher takes the run over and
    # both act on it. Past half the lease it waits (no action, no write) and tries again.
    clock = Clock()
    first = RunLock(run, host="login1", pid=1, clock=clock, lease_s=300)
    first.acquire()
    client = RecordingClient()
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig(), lock=first)
    w.step(job(), NODES, clock.now)

    def read_only(path, data):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    from slurmft.slurm.client import JobState
    def no_utime(path, times=None, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    with monkeypatch.context() as m:
        m.setattr(lockmod, "atomic_write_json", read_only)
        m.setattr(lockmod.os, "utime", no_utime)  # a renewal by mtime fails there too
        clock.now += 80  # a quarter has passed: renewal due, and it fails; the lease is still young
        first.keep()
        clock.now += 80  # 160 s old, past half of it
        w.step(job(JobState.FAILED, exit_code=1), NODES, clock.now)  # a crash it would requeue
        assert client.calls == [] and w.active  # waited, not let go
    clock.now += 10
    w.step(job(JobState.FAILED, exit_code=1), NODES, clock.now)  # renewed: acts again
    assert client.calls == [("requeue", "7")]


def test_leases_taken_in_one_cycle_are_not_all_renewed_in_one_cycle(tmp_path):
    """A watcher that takes 200 runs in its first cycle renewed all 200 leases in one cycle every
    lease_s/4 (the live benchmark at 1,000 runs: ~1,000 atomic writes, ~15 s, in one cycle). The
    first renewals are spread; each lease is still renewed at most lease_s/4 after the last."""
    clock = Clock()
    locks = []
    for i in range(200):
        rd = RunDir(tmp_path / f"run{i:03d}")
        rd.root.mkdir()
        held = RunLock(rd, host="login1", pid=1, clock=clock, lease_s=300)
        held.acquire()
        locks.append(held)
    last = {id(held): clock.now for held in locks}
    per_cycle = []
    for _ in range(60):  # 5 s cycles over a whole lease
        clock.now += 5
        renewed = 0
        for held in locks:
            was = held._renewed
            held.keep()
            if held._renewed != was:
                assert held._renewed - last[id(held)] <= 75, "renewed later than lease_s/4"
                last[id(held)] = held._renewed
                renewed += 1
        per_cycle.append(renewed)
    assert max(per_cycle) <= 200 // 3, per_cycle  # spread over at least 3 cycles (was 200 in one)
    assert all(clock.now - t <= 75 for t in last.values())
    assert 200 * 3 <= sum(per_cycle) <= 200 * 5  # every 64-75 s: 4 a lease period (+1 early)


def test_leases_renewed_together_in_one_long_cycle_drift_apart(tmp_path):
    """A first cycle that took minutes (a thousand runs taken on) leaves every lease due in the
    next cycle: renewed there together, they must not stay together for ever after."""
    clock = Clock()
    locks = []
    for i in range(100):
        rd = RunDir(tmp_path / f"run{i:03d}")
        rd.root.mkdir()
        held = RunLock(rd, host="login1", pid=1, clock=clock, lease_s=300)
        held.acquire()
        locks.append(held)
    clock.now += 200  # one long cycle: every lease overdue
    for held in locks:
        held.keep()
    per_cycle = []
    for _ in range(240):  # 20 minutes of 5 s cycles
        clock.now += 5
        renewed = 0
        for held in locks:
            was = held._renewed
            held.keep()
            renewed += held._renewed != was
        per_cycle.append(renewed)
    assert max(per_cycle[-60:]) <= 100 // 3, per_cycle[-60:]


def test_a_renewal_writes_nothing_but_the_mtime_and_a_takeover_is_still_found(run, node_local_flock):
    """A renewal is one ``utime`` of the lease this watcher wrote (no temp file, no fsync); its
    time is what another watcher reads; a lease replaced by another watcher is found at the
    next renewal, as before."""
    clock = Clock()
    held = RunLock(run, host="login1", pid=1, clock=clock, lease_s=300)
    held.acquire()
    path = run.root / "watch" / "lease.json"
    written = path.read_bytes()
    clock.now += 80
    held.keep()
    assert path.read_bytes() == written and path.stat().st_mtime == clock.now
    assert lockmod.read_lease(path).time == clock.now  # what a taker judges staleness by
    clock.now += 200  # 280 s since the last full write, 200 since the renewal: not stale
    with pytest.raises(LockError, match="already watched by pid 1 on login1"):
        RunLock(run, host="login2", pid=2, clock=clock).acquire()
    clock.now += 301  # login1 stalled: taken over, and login1 finds out before acting
    RunLock(run, host="login2", pid=2, clock=clock).acquire()
    with pytest.raises(LeaseLost):
        held.keep()


def test_the_recorded_time_is_rewritten_every_half_lease_for_readers_of_the_file_alone(
        run, node_local_flock):
    clock = Clock()
    held = RunLock(run, host="login1", pid=1, clock=clock, lease_s=300)
    held.acquire()
    path = run.root / "watch" / "lease.json"
    for _ in range(8):
        clock.now += 75
        held.keep()
        recorded = json.loads(path.read_text())["time"]
        assert clock.now - recorded < 150, (clock.now, recorded)
