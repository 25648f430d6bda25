"""``Run`` in one process (no process group): the step-boundary check, ``run.rng``, step numbering,
bad input. The multi-rank protocol is in test_run_dist.py."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from slurmft import exitcodes
from slurmft.journal import read_events
from slurmft.rundir import RunDir, read_done
from slurmft.train import CheckpointConfig, ResumeDivergenceWarning, Run, RunConfig
from slurmft.train.boundary import step_generator, step_seed

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURMFT_RUN_DIR")


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)


def make_run(run_dir, *, interval=3, **config):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, Run(model, optimizer, run_dir=run_dir,
                                 checkpoint=CheckpointConfig(interval=interval),
                                 config=RunConfig(watchdog=False, log_every=1, **config))


def draw_batch():
    x = torch.randn(8, 4)  # the global RNG, as most examples do
    return x, x.sum(dim=1, keepdim=True)


def train(model, optimizer, run, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    ok = run.report(loss=loss)
    optimizer.step()
    optimizer.zero_grad()
    return ok


@pytest.mark.timeout(60)
def test_prefetched_batch_warns_loudly(tmp_path):
    """The common loop: first batch drawn before the loop, the next one drawn before the save."""
    model, optimizer, run = make_run(tmp_path / "run")
    with pytest.warns(ResumeDivergenceWarning) as caught:
        with run:
            batch = draw_batch()
            for _step in run.steps(6):
                current = batch
                batch = draw_batch()  # prefetch: the global RNG moves before the boundary
                train(model, optimizer, run, current)
    messages = [str(w.message) for w in caught]
    assert any("between the start of the Run" in m and "torch" in m for m in messages), messages
    assert run._boundary.warnings >= 1


@pytest.mark.timeout(60)
def test_prefetch_after_report_warns_at_the_save(tmp_path):
    model, optimizer, run = make_run(tmp_path / "run")
    with pytest.warns(ResumeDivergenceWarning, match=r"after run.report\(\) in step 3, before its checkpoint"):
        with run:
            for _step in run.steps(4):
                train(model, optimizer, run, draw_batch())
                torch.rand(1)  # drawn after the step's report: lands in the saved RNG state


@pytest.mark.timeout(60)
def test_draws_inside_the_step_do_not_warn(tmp_path):
    model, optimizer, run = make_run(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeDivergenceWarning)
        with run:
            for step in run.steps(6):
                train(model, optimizer, run, draw_batch())
                gen = run.rng(step)  # the per-step generator never touches global state
                torch.randn(2, generator=gen)
    assert run._boundary.warnings == 0 and run.done


@pytest.mark.timeout(60)
def test_steps_are_one_based_and_resume_after_the_saved_step(tmp_path):
    run_dir = tmp_path / "run"
    model, optimizer, run = make_run(run_dir)
    run.config = RunConfig(watchdog=True, watchdog_timeout_s=60, log_every=1)
    seen = []
    with run:
        for step in run.steps(5):
            seen.append(step)
            if step == 4:
                break  # leaving early: step 4 never completed, no final save, no DONE
            train(model, optimizer, run, draw_batch())
        assert run.watchdog is None or run.watchdog.watching is None  # the unfinished step is not watched
    assert seen == [1, 2, 3, 4] and run.step == 3 and RunDir(run_dir).committed_steps() == [3]
    assert not RunDir(run_dir).done.exists()
    model, optimizer, run = make_run(run_dir)
    with run:
        assert run.restored_step == 3 and run.step == 3
        resumed = [step for step in run.steps(5) if train(model, optimizer, run, draw_batch()) or True]
    assert resumed == [4, 5] and read_done(RunDir(run_dir)).step == 5
    assert RunDir(run_dir).committed_steps() == [3, 5]
    losses = [e.get("step") for e in read_events(RunDir(run_dir).events, ["loss"])]
    assert losses == [1, 2, 3, 4, 5]


def test_step_generator_depends_on_seed_step_and_rank_only():
    a = torch.randn(3, generator=step_generator(1, 10, 0))
    torch.manual_seed(123)  # global state is irrelevant
    assert torch.equal(a, torch.randn(3, generator=step_generator(1, 10, 0)))
    seeds = {step_seed(1, 10, 0), step_seed(1, 11, 0), step_seed(1, 10, 1), step_seed(2, 10, 0),
             step_seed(1, 10, None)}
    assert len(seeds) == 5


@pytest.mark.timeout(60)
def test_missing_run_dir_exits_86_naming_it(tmp_path):
    code = ("import torch; from slurmft.train import Run\n"
            "Run(torch.nn.Linear(1, 1)).start()\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ENV_KEYS}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=env, cwd=tmp_path)
    assert proc.returncode == exitcodes.NO_REQUEUE
    assert proc.stderr.strip() == ("slurmft: no run directory: pass Run(run_dir=...) or set "
                                   "$SLURMFT_RUN_DIR -> NO_REQUEUE (86)")


def test_report_outside_a_step_is_an_error(tmp_path):
    model, optimizer, run = make_run(tmp_path / "run")
    with run, pytest.raises(RuntimeError, match="outside a step"):
        run.report(loss=1.0)


@pytest.mark.timeout(60)
def test_bad_config_value_exits_86_naming_the_key(tmp_path):
    code = "import torch; from slurmft.train import Run\nRun(torch.nn.Linear(1, 1))\n"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ENV_KEYS}
    env["SLURMFT_LOOP_LOG_EVERY"] = "often"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=env, cwd=tmp_path)
    assert proc.returncode == exitcodes.NO_REQUEUE
    assert proc.stderr.strip() == ("slurmft: [loop] log_every must be an integer, got 'often' "
                                   "-> NO_REQUEUE (86)")


@pytest.mark.timeout(60)
def test_preemption_check_every_setting_reaches_the_handler(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMFT_PREEMPTION_CHECK_EVERY", "3")
    model, optimizer, run = make_run(tmp_path / "run")
    with run:
        assert run.preemption is not None and run.preemption.check_every == 3
        for _step in run.steps(1):
            train(model, optimizer, run, draw_batch())


def test_loop_section_does_not_claim_the_run_dir_variable(tmp_path):
    # [loop], not [run]: SLURMFT_RUN_DIR must never be read as a key of Run's own section.
    config = RunConfig.load(environ={"SLURMFT_RUN_DIR": str(tmp_path), "SLURMFT_LOOP_LOG_EVERY": "1"})
    assert config.log_every == 1


@pytest.mark.timeout(60)
def test_bad_config_is_journaled_as_this_segments_deliberate_86(tmp_path):
    # torchrun turns the worker's 86 into 1: the launcher decides from the journal, which once had
    # nothing, so a config error was retried as a crash until the crash-loop limit.
    from slurmft.launch.outcome import Next, decide

    code = "import torch; from slurmft.train import Run\nRun(torch.nn.Linear(1, 1))\n"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in __import__("os").environ.items() if k not in ENV_KEYS}
    env.update(SLURMFT_LOOP_LOG_EVERY="often", SLURMFT_RUN_DIR=str(run_dir), SLURM_JOB_ID="41",
               SLURM_RESTART_COUNT="2")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=env, cwd=tmp_path)
    assert proc.returncode == exitcodes.NO_REQUEUE
    (end,) = read_events(RunDir(run_dir).events, ["segment_end"])
    assert (end.get("job_id"), end.get("restart_count"), end.get("exit_code")) == ("41", 2, exitcodes.NO_REQUEUE)
    assert "log_every must be an integer" in end.get("reason")
    assert decide(end.get("exit_code"), 1).next is Next.NO_REQUEUE  # what the launcher does with it


@pytest.mark.timeout(60)
def test_a_batch_drawn_before_the_run_is_caught_by_the_redone_steps_losses(tmp_path):
    # The first prefetched batch drawn BEFORE `with Run` (where it lands when a loop is wrapped),
    # the next one inside the step: the restore overwrites the RNG after the draw, so no RNG check
    # sees it, and the resumed run silently differed. The redone steps' losses tell.
    run_dir = tmp_path / "run"

    def loop(total, stop_after=None):
        model, optimizer, run = make_run(run_dir, check_boundaries=False)
        batch = draw_batch()  # before the Run: from the fresh seed, not from the restored state
        with run:
            for step in run.steps(total):
                current = batch
                batch = draw_batch()
                train(model, optimizer, run, current)
                if step == stop_after:
                    break
        return run

    loop(6, stop_after=5)                    # checkpoint at 3, steps 4 and 5 journaled, then "killed"
    with pytest.warns(ResumeDivergenceWarning, match=r"step 4 was redone after the resume with loss"):
        loop(6)
    (diverged,) = read_events(RunDir(run_dir).events, ["resume_diverged"])
    assert diverged.get("step") == 4 and diverged.get("loss") != diverged.get("journaled")


@pytest.mark.timeout(60)
def test_redone_steps_that_match_do_not_warn(tmp_path):
    run_dir = tmp_path / "run"

    def loop(total, stop_after=None):
        model, optimizer, run = make_run(run_dir)
        with run:
            for step in run.steps(total):
                train(model, optimizer, run, draw_batch())   # drawn inside the step: resumable
                if step == stop_after:
                    break

    loop(6, stop_after=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeDivergenceWarning)
        loop(6)
    assert read_events(RunDir(run_dir).events, ["resume_diverged"]) == []


def test_redone_losses_compare_only_like_with_like():
    from slurmft.train.redo_check import RedoneLosses

    redo = RedoneLosses({4: (1.0, 2), 5: (2.0, 4), 6: (3.0, 4)})
    assert redo.check(4, 1.5, world_size=4) is None           # journaled by 2 ranks: not comparable
    assert redo.check(5, 2.0 * (1 + 1e-6), world_size=4) is None   # a GPU's rounding
    assert redo.check(6, 3.3, world_size=4) is None           # only the first comparable step counts
    redo = RedoneLosses({6: (3.0, 4)})
    assert redo.check(6, 3.3, world_size=4).startswith("step 6 was redone")
    assert (redo.diverged_at, redo.journaled) == (6, 3.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raised, journaled", [(85, exitcodes.REQUEUE), (None, None), (0, None), ("bye", 1)])
def test_the_scripts_own_exit_inside_run_is_journaled_as_the_segment_end(tmp_path, raised, journaled):
    # torchrun turns a worker's `raise SystemExit(85)` into 1: without this line in the journal the
    # launcher sees a crash and the requeue the script asked for never happens.
    from slurmft.launch.outcome import Next, decide

    model, optimizer, run = make_run(tmp_path / "run")
    with pytest.raises(SystemExit):
        with run:
            for step in run.steps(10):
                train(model, optimizer, run, draw_batch())
                if step == 2:
                    raise SystemExit(raised)
    ends = read_events(RunDir(tmp_path / "run").events, ["segment_end"])
    if journaled is None:  # exit 0 before the end of steps(): no proof training finished
        assert ends == []
        return
    (end,) = ends
    assert (end.get("exit_code"), end.get("step")) == (journaled, 1)  # step: the last one completed
    assert f"the training script exited with code {journaled} after step 1" == end.get("reason")
    if journaled == exitcodes.REQUEUE:
        assert decide(end.get("exit_code"), 1).next is Next.REQUEUE


@pytest.mark.timeout(60)
def test_runs_own_exit_is_journaled_once(tmp_path):
    model, optimizer, run = make_run(tmp_path / "run")
    with run:
        for _step in run.steps(3):
            train(model, optimizer, run, draw_batch())
    ends = read_events(RunDir(tmp_path / "run").events, ["segment_end"])
    assert [e.get("exit_code") for e in ends] == [exitcodes.OK]


@pytest.mark.timeout(60)
def test_reporting_the_loss_tensor_itself_raises_no_warning(tmp_path):
    # report(loss=loss) with the graph still attached is what every loop does: no torch warning
    # ("Converting a tensor with requires_grad=True to a scalar") on the user's console.
    model, optimizer, run = make_run(tmp_path / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with run:
            for _step in run.steps(2):
                x = torch.ones(8, 4)
                loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
                loss.backward()
                run.report(loss=loss, grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                optimizer.step()
                optimizer.zero_grad()
    assert not [w for w in caught if "requires_grad" in str(w.message)]
