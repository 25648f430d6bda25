"""resume_check.ResumeCheck's rules on their own (torch-free): what is compared on which world
size, and a first batch that repeats an earlier start's only counts when the next one does not."""

from __future__ import annotations

from slurmft.train.resume_check import Print, ResumeCheck

A, B, C, R, S, T = ("a" * 16, "b" * 16, "c" * 16, "1" * 16, "2" * 16, "3" * 16)


def check(world: int = 2) -> ResumeCheck:
    # an earlier segment of world size 2: step 1 (its first) on inputs A, step 2 on B; checkpoint 3
    c = ResumeCheck(restored_step=3, world_size=world)
    c.prints = {1: Print(1, 2, R, A, None, True), 2: Print(2, 2, R, B, None, False),
                3: Print(3, 2, S, C, T, False)}
    c.firsts = {A: 1} if world == 2 else {}
    return c


def test_data_that_repeats_an_earlier_start_is_not_a_divergence():
    c = check()
    assert c.start(S, T, "here") is None
    assert c.after(4, R, A, None) is None  # like step 1: decided at the next step
    assert c.after(5, R, B, None) is None  # like step 2 too: an epoch that repeats, unshuffled


def test_a_first_batch_held_from_before_the_restore_is_named_at_the_first_step():
    c = check()
    assert c.after(4, R, A, None) is None
    found = c.after(5, R, "d" * 16, None)
    assert found is not None and (found.step, found.cause) == (4, "stale_inputs")
    assert c.after(6, R, A, None) is None  # only the first divergence is reported


def test_another_world_size_compares_only_the_sampler():
    c = check(world=3)
    assert c.start("9" * 16, T, "here") is None  # the RNG was reseeded for the new world
    found = check(world=3).start("9" * 16, "8" * 16, "here")
    assert found is not None and (found.step, found.cause) == (4, "sampler")


def test_the_restored_rng_must_be_the_saved_one_on_the_same_world_size():
    found = check().start(R, T, "between a:1 and a:2")
    assert found is not None and (found.step, found.cause) == (4, "rng_before_loop")
    assert "between a:1 and a:2" in found.message


def test_the_check_is_over_after_the_steps_the_interrupted_run_journaled():
    c = check()
    c.prints[9] = Print(9, 2, None, C, None, False)
    assert c.wants(4) and c.wants(9) and not c.wants(10)
    assert check().wants(5) and not check().wants(6)  # restored 3: its next two steps at least


def test_every_cause_comes_with_its_fix():
    # review30 finding 3: "every warning names the user's line that moved the RNG, with the fix";
    # the redone step's RNG and the sampler after a step said only what differed
    from slurmft.train.redo_check import RedoneLosses
    from slurmft.train.resume_check import Print

    def redone(rng=R, inputs=C, sampler=T):
        c = check()
        c.prints[4] = Print(4, 2, R, C, T, False)
        return c.after(4, rng, inputs, sampler)

    found = {
        "rng_before_loop": check().start("9" * 16, T, "here"),
        "sampler@start": check(world=3).start("9" * 16, "8" * 16, "here"),
        "inputs": redone(inputs="d" * 16),
        "rng": redone(rng="9" * 16),
        "sampler": redone(sampler="8" * 16),
    }
    c = check()
    c.after(4, R, A, None)
    found["stale_inputs"] = c.after(5, R, "d" * 16, None)
    fixes = {
        "rng_before_loop": "Draw each step's batch inside the step (or from run.rng(step)).",
        "sampler@start": "Take each step's batch from the sampler inside the step.",
        "inputs": "Draw each step's batch inside the step, after the previous run.report().",
        "rng": "Draw the same number of times in each step: keep a draw whose count depends on state "
               "outside the checkpoint (a counter, a clock, a file) out of the step, or carry that state "
               "in Run(extras=...).",
        "sampler": "Take exactly one batch from the sampler per step, inside the step, and nothing from "
                   "it between steps.",
        "stale_inputs": "Draw the first batch inside the loop (or after `with Run(...)` from run.rng(step)).",
    }
    for cause, divergence in found.items():
        assert divergence is not None and divergence.cause == cause.split("@")[0], (cause, divergence)
        assert divergence.message.endswith(fixes[cause]), (cause, divergence.message)
    losses = RedoneLosses({4: (1.0, 2)})
    assert losses.check(4, 2.0, world_size=2).endswith(
        "Draw each step's batch inside the step, and pass every stateful object the steps use to Run "
        "(sampler=..., extras=...).")
