"""Preemption flag agreement over real gloo process groups with 2 and 3 ranks."""

import os
import signal

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from slurmft.train.preemption import PreemptionHandler
from slurmft.launch import nodecheck


def _worker(rank, world, port, signal_rank, signal_step, check_every, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        handler = (PreemptionHandler() if check_every is None
                   else PreemptionHandler(check_every=check_every)).install()
        stop_step = None
        for step in range(1, 40):
            if rank == signal_rank and step == signal_step:
                os.kill(os.getpid(), signal.SIGUSR2)
                os.kill(os.getpid(), signal.SIGTERM)  # a second signal only sets the flag again
            if handler.should_stop():
                stop_step = step
                break
        results.put((rank, stop_step, handler.count, handler.received and handler.received.name,
                     handler.agreements))
        handler.uninstall()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    """Below the ephemeral range: a port bound later by the ranks, which another worker's
    connections must not take in between (slurmft.launch.nodecheck.free_port)."""
    return nodecheck.free_port()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, signal_rank, signal_step, check_every, expect", [
    (2, 1, 5, 1, 5),
    (3, 2, 7, 4, 8),  # checked on calls 4, 8, ...: every rank stops at the same later step
    (2, 0, 3, None, 10),  # the default agrees every 10 steps: at most 10 steps of added latency
])
def test_all_ranks_stop_at_the_same_step(world, signal_rank, signal_step, check_every, expect):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(world, _free_port(), signal_rank, signal_step, check_every,
                                      results), nprocs=world, start_method="spawn")
    got = sorted(results.get(timeout=10) for _ in range(world))
    assert [stop for _, stop, _, _, _ in got] == [expect] * world
    # one collective per check_every steps, not one per step
    assert [agreed for *_, agreed in got] == [expect // (check_every or 10)] * world
    for rank, _, count, name, _ in got:
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


def test_preemption_config_default_and_errors(tmp_path):
    from slurmft.config import ConfigError
    from slurmft.train.preemption import PreemptionConfig

    assert PreemptionConfig.load(environ={}).check_every == 10
    assert PreemptionConfig.load(environ={"SLURMFT_PREEMPTION_CHECK_EVERY": "3"}).check_every == 3
    toml = tmp_path / "slurmft.toml"
    toml.write_text("[preemption]\ncheck_every = 0\n")
    with pytest.raises(ConfigError, match="check_every must be >= 1"):
        PreemptionConfig.load(toml, environ={})
