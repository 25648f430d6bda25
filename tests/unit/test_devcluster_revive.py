"""What ``reset`` does to a node's slurmd and says when it cannot bring a node back, on real
processes (no Slurm needed; the real devcluster: tests/integration/test_devcluster_reset.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmft.slurm.devcluster import nodeprocs
from slurmft.slurm.devcluster.daemons import DaemonFailed
from slurmft.slurm.devcluster.nodeprocs import kill_node_tree, node_processes
from slurmft.slurm.devcluster.procs import ProcId, describe, exit_code, identify, is_alive, read_stat
from slurmft.slurm.devcluster.revive import Revival, check_started, explain, revive_node

MARK = "SLURMFT_DEVCLUSTER_NODE"
# Per process: kill_node_tree kills every process marked with the cluster and node, machine-wide,
# and xdist runs this module's tests in parallel workers (a fixed name killed another worker's
# sleepers: "pid 1810 never reached state T: Z" in a fresh-clone run).
CLUSTER = f"sftunit{os.getpid()}"
NODE_MARK = f"{CLUSTER}:n1"
pytestmark = pytest.mark.timeout(30)


def _sleeper(env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], ProcId]:
    proc = subprocess.Popen(["sleep", "60"], env={**os.environ, **(env or {})}, start_new_session=True)
    ident = identify(proc.pid)
    assert ident is not None
    return proc, ident


def _state(proc: ProcId) -> str | None:
    stat = read_stat(proc.pid)
    return None if stat is None or stat.start_time != proc.start_time else stat.state


def _wait_state(proc: ProcId, want: str) -> None:
    deadline = time.monotonic() + 10
    while _state(proc) != want:
        assert time.monotonic() < deadline, f"pid {proc.pid} never reached state {want}: {_state(proc)}"
        time.sleep(0.02)


def _cleanup(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_a_member_the_second_look_misses_is_killed_not_left_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member seen by the first look and frozen, then not counted by any later one (it exec'd
    without the node's environment and its parent is gone): the old kill left it SIGSTOPped
    for ever, holding what it held of the node."""
    member, ident = _sleeper({MARK: NODE_MARK})
    looks = []
    real = nodeprocs.node_processes

    def second_look_misses_it(*args: object) -> list[ProcId]:
        found = real(*args)  # type: ignore[arg-type]
        looks.append(found)
        return [p for p in found if p != ident] if len(looks) >= 2 else found

    monkeypatch.setattr(nodeprocs, "node_processes", second_look_misses_it)
    try:
        assert kill_node_tree(CLUSTER, "n1", None, MARK) == []
        assert ident in looks[0]
        assert not is_alive(ident), describe(ident)  # old code: still there, stopped (T)
        assert exit_code(ident) == -signal.SIGKILL
    finally:
        _cleanup(member)


def test_describe_names_state_exit_status_and_signal() -> None:
    stopped, ident = _sleeper()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        _wait_state(ident, "T")
        assert describe(ident).startswith(f"pid {stopped.pid} stopped (T)")
    finally:
        _cleanup(stopped)
    assert describe(ident) == f"pid {stopped.pid} gone"  # reaped by Popen: no status of ours
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2); raise SystemExit(3)"])
    child_id = identify(child.pid)
    assert child_id is not None
    deadline = time.monotonic() + 10
    while is_alive(child_id):  # reaped by is_alive's caller below, not by Popen
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert describe(child_id) == f"pid {child.pid} gone (exit status 3)"
    child.returncode = 3


def test_a_stopped_slurmd_is_continued_not_replaced() -> None:
    slurmd, ident = _sleeper({MARK: NODE_MARK})
    try:
        os.kill(slurmd.pid, signal.SIGSTOP)
        _wait_state(ident, "T")
        done = Revival()
        revive_node(CLUSTER, "n1", ident, MARK, lambda: pytest.fail("spawned a second slurmd"), done)
        assert done.continued == {"n1": ident} and not done.started
        assert _state(ident) in ("S", "R")
    finally:
        _cleanup(slurmd)


def test_a_dead_slurmd_is_restarted_only_after_the_node_s_leftovers_are_killed() -> None:
    leftover, left_id = _sleeper({MARK: NODE_MARK})
    os.kill(leftover.pid, signal.SIGSTOP)  # what an interrupted kill leaves: frozen for ever
    dead, dead_id = _sleeper()
    _cleanup(dead)
    new, new_id = _sleeper()
    seen_at_spawn: list[list[ProcId]] = []

    def spawn() -> ProcId:
        seen_at_spawn.append(node_processes(CLUSTER, "n1", None, MARK))
        return new_id

    try:
        done = Revival()
        revive_node(CLUSTER, "n1", dead_id, MARK, spawn, done)
        assert seen_at_spawn == [[]]
        assert exit_code(left_id) == -signal.SIGKILL
        assert done.started["n1"][0] == new_id and done.leftovers == {"n1": 1}
        check_started(done, lambda node: [])  # it runs: no error
        _cleanup(new)
        with pytest.raises(DaemonFailed, match=rf"slurmd it started for n1 exited \(pid {new.pid} gone"):
            check_started(done, lambda node: [])
    finally:
        _cleanup(leftover, new)


def test_explain_names_the_slurmd_its_state_and_the_node_s_other_processes(tmp_path: Path) -> None:
    slurmd, ident = _sleeper({MARK: NODE_MARK})
    step, step_id = _sleeper({MARK: NODE_MARK})
    try:
        _wait_state(step_id, "S")  # fresh from fork, it may still be running (R) on a loaded box
        os.kill(slurmd.pid, signal.SIGSTOP)
        _wait_state(ident, "T")
        done = Revival(started={"n1": (ident, time.monotonic())})
        text = explain(["n1"], CLUSTER, {"n1": ident}, MARK, done, lambda node: "last line")
        assert text.startswith(f"n1: slurmd pid {slurmd.pid} stopped (T)"), text
        assert "started by this reset" in text and f"pid {step.pid} sleeping" in text
        assert text.endswith("its log ends: last line")
        assert "no slurmd recorded" in explain(["n2"], CLUSTER, {"n2": None}, MARK, Revival(), lambda n: "")
    finally:
        _cleanup(slurmd, step)


def test_a_slurmd_a_previous_reset_waited_on_in_vain_is_replaced() -> None:
    slurmd, ident = _sleeper({MARK: NODE_MARK})
    new, new_id = _sleeper()
    try:
        _wait_state(ident, "S")  # fresh from fork, it may still be running (R) on a loaded box
        done = Revival()
        revive_node(CLUSTER, "n1", ident, MARK, lambda: new_id, done, unanswered=True)
        assert not is_alive(ident) and exit_code(ident) == -signal.SIGKILL
        assert done.started["n1"][0] == new_id
        assert done.replaced["n1"].startswith(f"pid {slurmd.pid} sleeping")
        text = explain(["n1"], CLUSTER, {"n1": new_id}, MARK, done, lambda node: "")
        assert f"replacing pid {slurmd.pid} sleeping" in text
    finally:
        _cleanup(slurmd, new)
