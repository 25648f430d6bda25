"""Ranks that checkpoint with gloo and then leave the normal way (interpreter teardown) exit 0.

A gloo worker or a Python thread still inside torch when Python 3.11 finalizes is killed by
``pthread_exit`` as it waits for the GIL; the unwind runs into a C++ destructor and ends in
``std::terminate`` ("terminate called without an active exception", SIGABRT), turning a finished
job into a failed one. Each run here is two real ranks (gloo over a file store) that:

1. save and ``close()``: the manager's gloo worker threads must be gone when ``close`` returns;
2. start a second save and fall off the end of the script without ``wait``, ``close`` or
   ``destroy_process_group``: interpreter exit must finish that save (it is committed) and exit 0.

Before the manager was closed at exit, step 2 aborted both ranks in 11 of 12 runs (and lost the
save in the 12th). The three worlds run side by side (each its own store and run dir), so a warm
server forks a rank while it holds other ranks' connections: until the fork closed those through
their objects (``slurmft.launch.warm``), collecting them at the rank's exit closed the rank's own
gloo fds by number: gloo's ``EnforceNotMet`` abort in one rank and its peer hung in teardown
joining gloo's loop (2 of 3 worlds); one after another, most likely the "60 s more" sometimes
seen (a number freed by the fork taken by the rank's gloo before the worker's own pidfd). The ranks use the product's default process-group
timeout (600 s, ``SLURMFT_PG_TIMEOUT_S``), so a rank whose exit waits out a collective misses the
test's bound instead of passing late, and a save abandoned at exit ("giving up") fails it.
A one-rank test in this process checks ``close()`` after a global ``destroy_process_group()``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
from gloo_threads import gloo_threads  # also imported by the rank script

from slurmft.rundir import RunDir
from slurmft.checkpoint.manager import CheckpointManager
from slurmft.checkpoint.state import TrainState

RUNS = 3
HELPERS = Path(__file__).resolve().parents[1] / "helpers"

pytest_plugins = ("warm_ranks",)   # the session fixture: ranks forked from a warm server
if TYPE_CHECKING:
    from warm_ranks import WarmRanks

RANK_SCRIPT = textwrap.dedent("""
    import atexit
    import os
    import sys
    import time
    from datetime import timedelta

    # Registered first, so it runs after the managers' own exit handlers (atexit is LIFO).
    LEFT = float("nan")  # when the script ended
    atexit.register(lambda: print(f"rank {sys.argv[1]}: exit handlers done "
                                  f"{time.monotonic() - LEFT:.1f} s after the script's end", flush=True))
    import torch, torch.distributed as dist
    from slurmft.checkpoint.manager import CheckpointManager
    from slurmft.checkpoint.state import TrainState

    sys.path.insert(0, sys.argv[4])
    from gloo_threads import gloo_threads

    rank, store, run_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    state = TrainState(model, optimizer)

    before = set(os.listdir("/proc/self/task"))  # by id: a new thread is named only once it runs
    manager = CheckpointManager(run_dir)
    manager.save(1, state, block=True)
    manager.close()
    # A joined thread can linger in /proc for a moment; one that was never joined stays.
    deadline = time.monotonic() + 10
    while gloo_threads() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    if gloo_threads() - before:
        sys.exit(f"rank {rank}: {len(gloo_threads() - before)} checkpoint gloo thread(s) left after close()")

    in_flight = CheckpointManager(run_dir)
    in_flight.save(2, state)
    print(f"rank {rank}: leaving with the step-2 save in flight", flush=True)
    LEFT = time.monotonic()
""")


def _start_world(ranks: WarmRanks, script: Path, tmp: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    logs = [tmp / f"rank{rank}.log" for rank in range(2)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "wb") as out:
            procs.append(ranks.popen(
                [sys.executable, str(script), str(rank), str(tmp / "store"), str(tmp / "run"), str(HELPERS)],
                env=env, rank=rank, stdout=out, stderr=subprocess.STDOUT))
    return procs, logs


def _output(logs: list[Path]) -> str:
    return "\n----\n".join(log.read_text(errors="replace")[-2000:] for log in logs)


@pytest.mark.timeout(600)
def test_ranks_exit_zero_after_checkpointing_and_a_normal_interpreter_exit(tmp_path, warm_ranks):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    worlds = []
    try:
        for attempt in range(RUNS):
            tmp = tmp_path / f"run{attempt}"
            tmp.mkdir()
            worlds.append((tmp, *_start_world(warm_ranks, script, tmp)))
        # A liveness bound, below the ranks' 600 s process-group timeout: an exit that waits one
        # out fails here. A world ends ~1 s after its start on a quiet box; at load 20-30 the
        # interpreter's teardown after the exit handlers alone takes 5-10 s.
        deadline = time.monotonic() + 240
        try:
            codes = [[proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
                     for _, procs, _ in worlds]
        except subprocess.TimeoutExpired:
            pytest.fail("the ranks of three 2-rank worlds did not all exit within 240 s:\n"
                        + "\n====\n".join(_output(logs) for _, _, logs in worlds))
    finally:
        for _, procs, _ in worlds:
            warm_ranks.kill_all(procs)
    for attempt, (tmp, _, logs) in enumerate(worlds):
        output = _output(logs)
        assert codes[attempt] == [0, 0], f"run {attempt}: ranks exited {codes[attempt]}:\n{output}"
        assert "terminate called" not in output, output
        assert "giving up on the checkpoint save at exit" not in output, output
        assert output.count("exit handlers done") == 2, output
        assert RunDir(tmp / "run").committed_steps() == [1, 2], output


@pytest.mark.timeout(60)
def test_close_after_a_global_destroy_process_group_joins_the_groups(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    before = set(os.listdir("/proc/self/task"))
    try:
        model = torch.nn.Linear(4, 2)
        manager = CheckpointManager(tmp_path / "run")
        manager.save(1, TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)), block=True)
        assert gloo_threads() - before, "the manager's groups should have gloo threads"
    finally:
        dist.destroy_process_group()  # every group, the manager's included, as scripts often end
    manager.close()  # used to raise ValueError: its groups were already unregistered
    manager.close()  # idempotent
    deadline = time.monotonic() + 10  # a joined thread can linger in /proc for a moment
    while gloo_threads() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not gloo_threads() - before
    assert RunDir(tmp_path / "run").committed_steps() == [1]


DEAD_PEER_SCRIPT = textwrap.dedent("""
    import os
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from slurmft.checkpoint.manager import CheckpointConfig, CheckpointManager
    from slurmft.checkpoint.state import TrainState

    rank, store, run_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if rank == 1:  # this rank stops dead at its first shard write, like a peer that hung or died
        os.environ["SLURMFT_CKPT_FAULT"] = "write"
        os.environ["SLURMFT_CKPT_FAULT_MARK"] = sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    model = torch.nn.Linear(8, 4)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    manager = CheckpointManager(run_dir, CheckpointConfig(timeout_s=600, exit_timeout_s=2))
    manager.save(1, state)  # rank 0's save then waits for rank 1 inside DCP's collectives
    if rank == 0:
        while not os.path.exists(sys.argv[4]):
            pass
        print("rank 0: exiting with the save stuck on rank 1", flush=True)
        sys.exit(85)  # atexit closes the manager: it must give up on the save, not wait 600 s
    import time
    time.sleep(600)
""")


@pytest.mark.timeout(120)
def test_a_rank_exits_within_its_exit_bound_while_its_save_waits_on_a_dead_peer(tmp_path, warm_ranks):
    script = tmp_path / "rank.py"
    script.write_text(DEAD_PEER_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    for key in ("SLURMFT_CKPT_FAULT", "SLURMFT_CKPT_FAULT_MARK", "SLURMFT_CKPT_FAULT_DELAY"):
        env.pop(key, None)
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "wb") as out:
            procs.append(warm_ranks.popen(
                [sys.executable, str(script), str(rank), str(tmp_path / "store"), str(tmp_path / "run"),
                 str(tmp_path / "mark")], env=env, rank=rank, stdout=out, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "mark").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "mark").exists(), logs[1].read_text(errors="replace")
        t0 = time.monotonic()
        code = procs[0].wait(timeout=60)
        waited = time.monotonic() - t0
    finally:
        warm_ranks.kill_all(procs)
    output = logs[0].read_text(errors="replace")
    assert code == 85, output
    assert waited < 30, output
    assert "giving up on the checkpoint save at exit: checkpoint save of step 1 still in flight" in output
    assert RunDir(tmp_path / "run").committed_steps() == []
