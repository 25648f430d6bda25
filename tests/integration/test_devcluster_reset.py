"""``reset`` brings back a node whose slurmd is stopped, or dead with a frozen leftover beside
it, on the real devcluster (the rules themselves, on plain processes: tests/unit/test_devcluster_revive.py).

Why: the release matrix's sid run under load timed out in every reset after a ``kill_node``
with only "n1=IDLE+NOT_RESPONDING"; no slurmd of n1 ever started again. These are the states a
frozen kill can leave, and what reset must do with each instead of waiting out its bound."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from slurmft.slurm.devcluster import DevCluster, DevClusterError
from slurmft.slurm.devcluster.daemons import NODE_MARK_ENV
from slurmft.slurm.devcluster.procs import ProcId, exit_code, identify, is_alive, is_stopped

pytestmark = pytest.mark.integration


def _run_on(cluster: DevCluster, node: str, tmp_path: Path) -> None:
    """A job on ``node`` starts and ends: its slurmd really serves (not only looks IDLE)."""
    done = subprocess.run(["srun", "-N1", "-w", node, "--time=1", "true"], capture_output=True, text=True,
                          env={**os.environ, **cluster.env}, timeout=60, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(120)
def test_reset_continues_a_stopped_slurmd(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    slurmd = slurm_cluster.processes()["slurmd-n1"]
    os.kill(slurmd.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not is_stopped(slurmd):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    slurm_cluster.reset()  # old: the controller still said IDLE, so "clean", and left it stopped
    assert not is_stopped(slurmd) and slurm_cluster.processes()["slurmd-n1"] == slurmd
    _run_on(slurm_cluster, "n1", tmp_path)


def _process_of(cluster: DevCluster, node: str) -> tuple[subprocess.Popen[bytes], ProcId]:
    """A process the devcluster counts as ``node``'s (its mark), e.g. one a kill left behind."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True,
                            env={**os.environ, NODE_MARK_ENV: f"{cluster.cluster_name}:{node}"})
    ident = identify(proc.pid)
    assert ident is not None
    return proc, ident


@pytest.mark.timeout(120)
def test_reset_kills_a_dead_node_s_frozen_leftover_before_restarting_it(slurm_cluster: DevCluster,
                                                                       tmp_path: Path) -> None:
    slurm_cluster.kill_node("n2")
    # What an interrupted kill leaves: a process of the node, frozen (SIGSTOP) for ever.
    leftover, ident = _process_of(slurm_cluster, "n2")
    try:
        os.kill(leftover.pid, signal.SIGSTOP)
        slurm_cluster.reset()
        assert not is_alive(ident), "reset left the node's frozen leftover beside its new slurmd"
        assert exit_code(ident) == -signal.SIGKILL
        assert slurm_cluster.node_alive("n2")
        _run_on(slurm_cluster, "n2", tmp_path)
    finally:
        if is_alive(ident):
            os.kill(leftover.pid, signal.SIGKILL)
            leftover.wait(5)


@pytest.mark.timeout(240)
def test_a_slurmd_that_never_answers_is_named_then_replaced(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    """The sid matrix's failure, made on purpose: n3's slurmd process runs but its node never
    answers. reset must say which process (pid, state) at its deadline, and the next reset must
    replace it rather than wait on it again (the old reset timed out on "n3=IDLE+NOT_RESPONDING"
    in every test after)."""
    slurm_cluster.kill_node("n3")
    hung, ident = _process_of(slurm_cluster, "n3")
    try:
        slurm_cluster._record("slurmd-n3", ident)  # a slurmd that runs and never registers
        deadline = time.monotonic() + 60  # SlurmdTimeout=10: NOT_RESPONDING after ~15 s
        while "NOT_RESPONDING" not in slurm_cluster.nodes()["n3"].flags:
            assert time.monotonic() < deadline, slurm_cluster.nodes()["n3"]
            time.sleep(0.5)
        with pytest.raises(DevClusterError) as err:
            slurm_cluster.reset(timeout=10)
        text = str(err.value)
        print(text)
        assert f"n3: slurmd pid {hung.pid} sleeping (S)" in text, text
        assert "not restarted (alive when reset began)" in text and "processes of n3: pid" in text, text
        slurm_cluster.reset()
        assert not is_alive(ident) and exit_code(ident) == -signal.SIGKILL
        assert slurm_cluster.node_alive("n3") and slurm_cluster.processes()["slurmd-n3"] != ident
        _run_on(slurm_cluster, "n3", tmp_path)
    finally:
        if hung.poll() is None and is_alive(ident):
            os.kill(hung.pid, signal.SIGKILL)
            hung.wait(5)
