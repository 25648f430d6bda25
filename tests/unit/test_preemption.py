"""Preemption flag agreement over real gloo process groups with 2 and 3 ranks."""

import os
import signal

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from slurmft.train.preemption import PreemptionHandler


def _worker(rank, world, port, signal_rank, signal_step, check_every, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        handler = PreemptionHandler(check_every=check_every).install()
        stop_step = None
        for step in range(1, 40):
            if rank == signal_rank and step == signal_step:
                os.kill(os.getpid(), signal.SIGUSR2)
                os.kill(os.getpid(), signal.SIGTERM)  # a second signal only sets the flag again
            if handler.should_stop():
                stop_step = step
                break
        results.put((rank, stop_step, handler.count, handler.received and handler.received.name))
        handler.uninstall()
    finally:
        dist.destroy_process_group()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, signal_rank, signal_step, check_every, expect", [
    (2, 1, 5, 1, 5),
    (3, 2, 7, 4, 8),  # checked on calls 4, 8, ...: every rank stops at the same later step
])
def test_all_ranks_stop_at_the_same_step(world, signal_rank, signal_step, check_every, expect):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(world, _free_port(), signal_rank, signal_step, check_every,
                                      results), nprocs=world, start_method="spawn")
    got = sorted(results.get(timeout=10) for _ in range(world))
    assert [stop for _, stop, _, _ in got] == [expect] * world
    for rank, _, count, name in got:
        if rank == signal_rank:
            assert (count, name) == (2, "SIGTERM")
        else:
            assert (count, name) == (0, None)


def test_handler_restores_previous_handlers():
    before = signal.getsignal(signal.SIGUSR2)
    with PreemptionHandler() as handler:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handler.requested and handler.should_stop()
    assert signal.getsignal(signal.SIGUSR2) == before
