"""ForwardTimer: a rank's own forward time (the heartbeat's busy_s; the watcher's straggler rule
fed by such heartbeats is tested in test_watch_runwatch.py)."""

import time

import torch

from slurmft.train.busy import ForwardTimer


class Sleepy(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.02)
        return x


def test_forward_time_is_summed_between_takes_and_hooks_come_off():
    model = Sleepy()
    timer = ForwardTimer(model)
    assert timer.take() is None  # no forward yet
    model(torch.zeros(1))
    model(torch.zeros(1))   # gradient accumulation: both count
    took = timer.take()
    assert 0.04 <= took < 1.0
    assert timer.take() is None
    timer.remove()
    model(torch.zeros(1))
    assert timer.take() is None


def test_a_compiled_module_still_runs_with_the_timer_hooked():
    # model.compile() traces the module's own hooks; fullgraph=True once failed on the timer.
    model = torch.nn.Linear(4, 4)
    timer = ForwardTimer(model)
    model.compile(backend="eager", fullgraph=True)
    model(torch.zeros(2, 4))   # must not raise
    wrapper = torch.compile(torch.nn.Linear(4, 4), backend="eager", fullgraph=True)
    outer = ForwardTimer(wrapper)   # hooks on the wrapper run outside the compiled code: timed
    wrapper(torch.zeros(2, 4))
    assert outer.take() is not None
    timer.remove()
    outer.remove()
