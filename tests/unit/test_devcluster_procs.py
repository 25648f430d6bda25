"""Process identity and node process trees, on real processes (no Slurm needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from slurmft.slurm.devcluster.nodeprocs import belongs_to_node, kill_node_tree, node_processes
from slurmft.slurm.devcluster.procs import ProcId, identify, is_alive, terminate

MARK = "SLURMFT_DEVCLUSTER_NODE"


def test_identity_includes_start_time() -> None:
    me = identify(os.getpid())
    assert me is not None and is_alive(me)
    assert not is_alive(ProcId(me.pid, me.start_time + 1))


def test_belongs_to_node() -> None:
    assert belongs_to_node({MARK: "sfta:n1"}, "sfta", "n1", MARK)
    assert not belongs_to_node({MARK: "sftb:n1"}, "sfta", "n1", MARK)
    task = {"SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": "sfta"}
    assert belongs_to_node(task, "sfta", "n1", MARK)
    assert not belongs_to_node(task, "sftb", "n1", MARK)  # same node name, other cluster
    assert not belongs_to_node(task, "sfta", "n2", MARK)


def _spawn(env: dict[str, str]) -> subprocess.Popen[bytes]:
    # A parent with a child that clears its own environment: found only by ancestry.
    script = "sleep 60 & env -i sleep 61 & wait"
    return subprocess.Popen(["sh", "-c", script], env={**os.environ, **env},
                            start_new_session=True)


@pytest.mark.timeout(30)
def test_kill_node_tree_kills_marked_tasks_and_their_children_only() -> None:
    ours = _spawn({MARK: "sftunit:n1"})
    task = _spawn({"SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": "sftunit"})
    other = _spawn({"SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": "sftother"})
    try:
        deadline = time.monotonic() + 10
        while len(node_processes("sftunit", "n1", None, MARK)) < 6:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert kill_node_tree("sftunit", "n1", None, MARK) == []
        ours.wait(5)
        task.wait(5)
        assert node_processes("sftunit", "n1", None, MARK) == []
        assert other.poll() is None
    finally:
        for proc in (ours, task, other):
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(5)


@pytest.mark.timeout(30)
def test_terminate_escalates_to_sigkill() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"1\n"
    ident = identify(proc.pid)
    assert ident is not None
    started = time.monotonic()
    assert terminate([ident], grace=0.5) == []  # reaps it too: Popen can no longer see -9
    assert 0.5 <= time.monotonic() - started < 5  # SIGTERM was ignored for the whole grace
    assert not is_alive(ident)
