"""Retention: the pure prune plan and applying it to a run dir (torch-free)."""

import random

import pytest

from slurmft.rundir import RunDir
from slurmft.checkpoint.manifest import tmp_dirname
from slurmft.checkpoint.retention import (
    PrunePlan,
    RetentionPolicy,
    apply_prune,
    plan_prune,
    scan_checkpoint_dirs,
)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"keep_last": 0}, "keep_last must be an integer >= 1"),
        ({"keep_last": True}, "keep_last must be an integer >= 1"),
        ({"keep_every": 0}, "keep_every must be an integer >= 1 or unset"),
        ({"milestones": frozenset({-5})}, "milestones must be integers >= 0"),
    ],
)
def test_policy_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetentionPolicy(**kwargs)


def test_keep_last():
    plan = plan_prune([100, 200, 300, 400], 400, [], RetentionPolicy(keep_last=2))
    assert plan == PrunePlan(keep_steps=(300, 400), delete_steps=(100, 200), delete_tmp_dirs=())


def test_keep_every_and_milestones():
    steps = range(100, 1100, 100)
    plan = plan_prune(steps, 1000, [], RetentionPolicy(keep_last=1, keep_every=500, milestones=frozenset({300})))
    assert plan.keep_steps == (300, 500, 1000)
    assert plan.delete_steps == (100, 200, 400, 600, 700, 800, 900)


def test_newest_valid_is_never_deleted():
    # The two newest are committed but failed verification: the restart would load 200.
    plan = plan_prune([100, 200, 300, 400], 200, [], RetentionPolicy(keep_last=1))
    assert plan.keep_steps == (200, 400)
    assert plan.delete_steps == (100, 300)


def test_nothing_valid_deletes_no_committed_checkpoint():
    plan = plan_prune([100, 200], None, [tmp_dirname(150, "a")], RetentionPolicy(keep_last=1))
    assert plan.delete_steps == ()
    assert plan.delete_tmp_dirs == (tmp_dirname(150, "a"),)


def test_tmp_dirs_at_or_below_newest_commit_are_abandoned():
    tmps = [tmp_dirname(150, "old"), tmp_dirname(200, "dup"), tmp_dirname(250, "live")]
    plan = plan_prune([100, 200], 200, tmps, RetentionPolicy(keep_last=5))
    assert plan.delete_tmp_dirs == (tmp_dirname(150, "old"), tmp_dirname(200, "dup"))
    assert plan_prune([], None, tmps, RetentionPolicy()).empty


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="newest valid step 300 is not among the committed steps"):
        plan_prune([100, 200], 300, [], RetentionPolicy())
    with pytest.raises(ValueError, match="'step_000000001' is not a checkpoint tmp dir name"):
        plan_prune([100], 100, ["step_000000001"], RetentionPolicy())


def test_plan_invariants_on_random_inputs():
    rng = random.Random(1234)
    for _ in range(500):
        steps = sorted(rng.sample(range(0, 5000, 10), rng.randint(1, 30)))
        valid = rng.choice(steps + [None])
        policy = RetentionPolicy(
            keep_last=rng.randint(1, 5),
            keep_every=rng.choice([None, 50, 500]),
            milestones=frozenset(rng.sample(steps, min(2, len(steps)))),
        )
        plan = plan_prune(steps, valid, [], policy)
        assert sorted(plan.keep_steps + plan.delete_steps) == steps
        assert set(steps[-policy.keep_last:]) <= set(plan.keep_steps)
        assert policy.milestones <= set(plan.keep_steps)
        if valid is None:
            assert plan.delete_steps == ()
        else:
            assert valid in plan.keep_steps
        assert all(not policy.protects(s) for s in plan.delete_steps)


def test_apply_prune_on_a_run_dir(tmp_path):
    run = RunDir(tmp_path)
    for step in (100, 200, 300):
        run.checkpoint(step).mkdir(parents=True)
        (run.checkpoint(step) / "__0_0.distcp").write_bytes(b"x" * step)
    (run.checkpoints / tmp_dirname(250, "dead") / "sub").mkdir(parents=True)
    (run.checkpoints / tmp_dirname(400, "live")).mkdir()

    committed, tmps = scan_checkpoint_dirs(tmp_path)
    assert committed == [100, 200, 300]
    assert tmps == [tmp_dirname(250, "dead"), tmp_dirname(400, "live")]
    plan = plan_prune(committed, 300, tmps, RetentionPolicy(keep_last=2))
    removed = apply_prune(tmp_path, plan)

    assert removed == [run.checkpoint(100), run.checkpoints / tmp_dirname(250, "dead")]
    assert scan_checkpoint_dirs(tmp_path) == ([200, 300], [tmp_dirname(400, "live")])
    # A second pruner working from the same stale plan finds nothing left to do.
    assert apply_prune(tmp_path, plan) == []


def test_scan_of_missing_checkpoints_dir(tmp_path):
    assert scan_checkpoint_dirs(tmp_path / "nope") == ([], [])
