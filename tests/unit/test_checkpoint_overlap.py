"""Overlapped staging in one process: what is copied before save() returns, the fence, its bound.

The save thread's copy is slowed down (it sleeps before copying) so that the next step really runs
while the copy is in flight; the two-rank FSDP2 version is in test_checkpoint_dist.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from slurmft.checkpoint.manager import CheckpointConfig, CheckpointError, CheckpointManager
from slurmft.checkpoint.overlap import InFlightCopy
from slurmft.checkpoint.state import TrainState

SLOW_COPY_S = 1.0


@pytest.fixture
def slow_copy(monkeypatch):
    finish = InFlightCopy.finish
    delay = {"s": SLOW_COPY_S}

    def slow_finish(self, timeout_s):
        time.sleep(delay["s"])
        finish(self, timeout_s)

    monkeypatch.setattr(InFlightCopy, "finish", slow_finish)
    return delay


def make_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 1))
    return TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_step(state, seed):
    torch.manual_seed(seed)
    state.model(torch.randn(16, 8)).pow(2).mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()


def full(state):
    return {"model": {k: v.clone() for k, v in state.model.state_dict().items()},
            "optim": {p: {k: v.clone() for k, v in s.items()}
                      for p, s in state.optimizer.state_dict()["state"].items()}}


def assert_same(a, b):
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for p in a["optim"]:
        for key in a["optim"][p]:
            assert torch.equal(a["optim"][p][key], b["optim"][p][key]), (p, key)


@pytest.mark.timeout(60)
def test_the_next_step_starts_at_once_and_the_checkpoint_holds_its_own_step(tmp_path, slow_copy):
    state = make_state()
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=5))
    train_step(state, 1)
    reference = full(state)
    manager.save(1, state)
    # The next forward changes BatchNorm's running statistics (copied before save returned); its
    # optimizer step waits in the pre-hook until parameters and Adam's state are copied.
    train_step(state, 2)
    train_step(state, 3)
    manager.wait()
    stats = manager.stats[-1]
    assert stats.committed
    assert stats.blocking_s < SLOW_COPY_S < stats.copied_s
    assert stats.fenced_s > 0 and stats.stall_s == stats.blocking_s + stats.fenced_s
    assert not torch.equal(state.model[1].running_mean, reference["model"]["1.running_mean"])
    fresh = make_state()
    assert CheckpointManager(tmp_path).load_latest(fresh) == 1
    assert_same(full(fresh), reference)


@pytest.mark.timeout(60)
def test_fence_lets_the_loop_change_weights_by_hand(tmp_path, slow_copy):
    state = make_state()
    train_step(state, 1)
    reference = full(state)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state)
    manager.fence()
    with torch.no_grad():
        state.model[0].weight.mul_(0.5)  # e.g. an EMA update, after the fence
    manager.wait()
    assert manager.stats[-1].committed
    fresh = make_state()
    assert CheckpointManager(tmp_path).load_latest(fresh) == 1
    assert_same(full(fresh), reference)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["weight", "adam_state"])
def test_an_unfenced_change_fails_that_save_and_keeps_the_previous(tmp_path, slow_copy, change):
    state = make_state()
    train_step(state, 1)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, block=True)
    kept = full(state)
    train_step(state, 2)
    manager.save(2, state)
    with torch.no_grad():
        if change == "weight":
            state.model[2].weight.add_(1.0)
        else:
            next(iter(state.optimizer.state.values()))["exp_avg"].zero_()
    manager.wait()
    failed = manager.stats[-1]
    assert failed.step == 2 and not failed.committed
    assert "changed while checkpoint save of step 2 was still copying it" in failed.error
    assert "fence()" in failed.error
    fresh = make_state()
    assert CheckpointManager(tmp_path).load_latest(fresh) == 1
    assert_same(full(fresh), kept)
    # Caught once: from then on this manager copies before save() returns, and the same loop saves.
    train_step(state, 3)
    manager.save(3, state)
    with torch.no_grad():
        state.model[2].weight.add_(1.0)
    manager.wait()
    assert manager.stats[-1].committed and manager.stats[-1].copied_s is None


@pytest.mark.timeout(60)
def test_without_overlap_the_copy_is_done_when_save_returns(tmp_path, slow_copy):
    state = make_state()
    train_step(state, 1)
    reference = full(state)
    manager = CheckpointManager(tmp_path, CheckpointConfig(overlap=False))
    manager.save(1, state)
    with torch.no_grad():
        state.model[0].weight.add_(1.0)  # no fence needed: nothing reads the live state any more
    manager.wait()
    stats = manager.stats[-1]
    assert stats.committed and stats.copied_s is None and stats.fenced_s == 0.0
    fresh = make_state()
    assert CheckpointManager(tmp_path).load_latest(fresh) == 1
    assert_same(full(fresh), reference)


@pytest.mark.timeout(60)
def test_the_optimizer_waits_for_a_stuck_copy_only_as_long_as_its_bound(tmp_path, slow_copy):
    slow_copy["s"] = 3.0
    state = make_state()
    train_step(state, 1)
    manager = CheckpointManager(tmp_path, CheckpointConfig(save_timeout_s=0.5))
    manager.save(1, state)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="state copy of checkpoint save of step 1 still in flight"):
        train_step(state, 2)
    assert time.monotonic() - started < 2.0
    slow_copy["s"] = 0.0
    manager.close()
    assert not state.optimizer._optimizer_step_pre_hooks  # close() took its hook off the optimizer


@pytest.mark.timeout(60)
def test_a_tensor_that_is_not_a_parameter_or_optimizer_state_is_copied_before_save_returns(tmp_path, slow_copy):
    state = make_state()
    train_step(state, 1)
    lr = torch.tensor(0.01)
    state.optimizer.param_groups[0]["lr"] = lr  # a tensor learning rate, which a scheduler fills in place
    manager = CheckpointManager(tmp_path)
    manager.save(1, state)
    lr.fill_(0.5)  # before the next optimizer.step(), no fence: not part of the deferred copy
    manager.wait()
    assert manager.stats[-1].committed
    fresh = make_state()
    fresh.optimizer.param_groups[0]["lr"] = torch.tensor(0.0)
    assert CheckpointManager(tmp_path).load_latest(fresh) == 1
    assert float(fresh.optimizer.param_groups[0]["lr"]) == pytest.approx(0.01)


@pytest.mark.timeout(60)
def test_without_an_optimizer_nothing_could_fence_so_the_copy_is_done_when_save_returns(tmp_path, slow_copy):
    torch.manual_seed(0)
    state = TrainState(torch.nn.Linear(4, 4))
    before = state.model.weight.detach().clone()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state)
    with torch.no_grad():
        state.model.weight.add_(1.0)
    manager.wait()
    assert manager.stats[-1].committed and manager.stats[-1].copied_s is None
    fresh = TrainState(torch.nn.Linear(4, 4))
    assert CheckpointManager(tmp_path).load_latest(fresh) == 1
    assert torch.equal(fresh.model.weight, before)


@pytest.mark.timeout(60)
def test_a_save_that_fails_after_staging_leaves_no_copy_for_the_optimizer_to_wait_on(tmp_path, slow_copy):
    state = make_state()
    train_step(state, 1)
    manager = CheckpointManager(tmp_path, CheckpointConfig(save_timeout_s=30))
    state.extras["bad"] = object()  # not JSON: save() raises while capturing the small values
    with pytest.raises(TypeError, match="extras state must be plain JSON"):
        manager.save(1, state)
    del state.extras["bad"]
    started = time.monotonic()
    train_step(state, 2)
    assert time.monotonic() - started < SLOW_COPY_S  # no copy in flight to fence
    manager.close()
