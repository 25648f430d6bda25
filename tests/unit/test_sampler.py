"""ResumableSampler: data order independent of world size; restarts neither repeat nor skip."""

import random

import pytest

from slurmft.train.sampler import BatchPlan, ResumableSampler, SamplerError


def _step_samples(samplers, step_count):
    """Run ``step_count`` steps on every rank's sampler; per step, the union of ranks' samples."""
    steps = []
    for _ in range(step_count):
        per_rank = [s.next_step() for s in samplers]
        steps.append([i for micro_batches in per_rank for mb in micro_batches for i in mb])
    return steps


def _ranks(n, gbs, world, micro=None, seed=7):
    return [ResumableSampler(n, gbs, rank=r, world_size=world, micro_batch_size=micro, seed=seed)
            for r in range(world)]


def test_world_size_does_not_change_the_order():
    ref = _step_samples(_ranks(100, 12, 1), 20)
    for world in (2, 3, 4, 6, 12):
        assert _step_samples(_ranks(100, 12, world), 20) == ref


def test_each_epoch_is_a_permutation_without_repeats():
    n, gbs = 103, 10
    steps = _step_samples(_ranks(n, gbs, 2), 20)  # 10 steps per epoch, 3 samples dropped
    for epoch in range(2):
        seen = [i for step in steps[epoch * 10:(epoch + 1) * 10] for i in step]
        assert len(seen) == len(set(seen)) == 100
    assert steps[:10] != steps[10:20]  # reshuffled per epoch


@pytest.mark.parametrize("trial", range(25))
def test_restarts_on_random_world_sizes_neither_repeat_nor_skip(trial):
    rng = random.Random(trial)
    n, gbs = rng.randint(40, 200), rng.choice([12, 24, 36])
    total = rng.randint(5, 40)
    ref = _step_samples(_ranks(n, gbs, 1, seed=trial), total)
    got, done, state = [], 0, None
    while done < total:
        world = rng.choice([w for w in (1, 2, 3, 4, 6, 12) if gbs % w == 0])
        samplers = _ranks(n, gbs, world, seed=trial)
        if state is not None:
            for s in samplers:
                s.load_state_dict(dict(state))
        run = min(total - done, rng.randint(1, 7))
        got += _step_samples(samplers, run)
        done += run
        state = samplers[0].state_dict()
        assert all(s.state_dict() == state for s in samplers)
        assert all(isinstance(v, int) for v in state.values())
    assert got == ref


def test_gradient_accumulation_keeps_the_global_batch():
    plan = BatchPlan.make(32, 4, 2)
    assert (plan.per_rank, plan.accumulation_steps) == (8, 4)
    sampler = ResumableSampler(100, 32, rank=1, world_size=4, micro_batch_size=2)
    micro_batches = sampler.next_step()
    assert len(micro_batches) == 4 and all(len(mb) == 2 for mb in micro_batches)


@pytest.mark.parametrize("gbs, world, micro, needle", [
    (10, 3, None, "not divisible by the world size 3"),
    (12, 2, 4, "not divisible by the micro-batch size 4"),
])
def test_impossible_geometry_is_a_clear_error(gbs, world, micro, needle):
    with pytest.raises(SamplerError, match=needle):
        ResumableSampler(100, gbs, rank=0, world_size=world, micro_batch_size=micro)


def test_restoring_a_different_data_order_is_refused():
    state = ResumableSampler(100, 10, rank=0, world_size=1, seed=1).state_dict()
    other = ResumableSampler(100, 10, rank=0, world_size=1, seed=2)
    with pytest.raises(SamplerError, match="seed=1 but this run has seed=2"):
        other.load_state_dict(state)
    wrong_gbs = ResumableSampler(100, 20, rank=0, world_size=1, seed=1)
    with pytest.raises(SamplerError, match="global_batch_size"):
        wrong_gbs.load_state_dict(state)
