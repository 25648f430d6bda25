"""Preemption flag agreement over real gloo process groups with 2 and 3 ranks."""

import os
import signal
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from slurmft.train.preemption import PreemptionHandler
from slurmft.launch import nodecheck


def _worker(rank, world, port, signal_rank, signal_step, check_every, results, step_s=0.0,
            check_interval_s=5.0):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        handler = (PreemptionHandler(check_interval_s=check_interval_s) if check_every is None
                   else PreemptionHandler(check_every=check_every,
                                          check_interval_s=check_interval_s)).install()
        stop_step = None
        for step in range(1, 40):
            time.sleep(step_s)
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


def _run(world, signal_rank, signal_step, check_every, **kwargs):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(world, _free_port(), signal_rank, signal_step, check_every,
                                      results, *kwargs.values()), nprocs=world, start_method="spawn")
    got = sorted(results.get(timeout=10) for _ in range(world))
    for rank, _, count, name, _ in got:
        if rank == signal_rank:
            assert (count, name) == (2, "SIGTERM")
        else:
            assert (count, name) == (0, None)
    return got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, signal_rank, signal_step, check_every, expect, agreements", [
    (2, 1, 5, 1, 5, 5),
    # calls 1 and 2 agree (the second measures), then every 4th: 6, 10, ... (an interval of 1e6 s:
    # the count alone decides, however slowly a loaded machine runs the loop)
    (3, 2, 7, 4, 10, 4),
    (2, 0, 3, None, 12, 3),  # the default: at most 10 steps of added latency when steps are fast
])
def test_all_ranks_stop_at_the_same_step(world, signal_rank, signal_step, check_every, expect,
                                         agreements):
    got = _run(world, signal_rank, signal_step, check_every, step_s=0.0, check_interval_s=1e6)
    assert [stop for _, stop, _, _, _ in got] == [expect] * world
    # one collective per check_every steps, not one per step
    assert [agreed for *_, agreed in got] == [agreements] * world


@pytest.mark.timeout(300)
def test_slow_steps_agree_within_the_interval_not_after_check_every_steps():
    """0.2 s steps, a 0.5 s interval: the ranks agree at least every 2nd step, so a signal at step 5
    stops both at step 5 or 6, not at the 10th call as a count of steps alone would (on a 60 s step,
    10 minutes past the grace time)."""
    got = _run(2, 1, 5, 10, step_s=0.2, check_interval_s=0.5)
    stops = [stop for _, stop, _, _, _ in got]
    assert stops[0] == stops[1] and stops[0] in (5, 6), stops


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
    assert PreemptionConfig.load(environ={}).check_interval_s == 5.0
    assert PreemptionConfig.load(environ={"SLURMFT_PREEMPTION_CHECK_INTERVAL_S": "60"}).check_interval_s == 60
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="check_interval_s must be a finite number"):
            PreemptionConfig.load(environ={"SLURMFT_PREEMPTION_CHECK_INTERVAL_S": bad})
    assert PreemptionConfig.load(environ={"SLURMFT_PREEMPTION_CHECK_EVERY": "3"}).check_every == 3
    toml = tmp_path / "slurmft.toml"
    toml.write_text("[preemption]\ncheck_every = 0\n")
    with pytest.raises(ConfigError, match="check_every must be >= 1"):
        PreemptionConfig.load(toml, environ={})
