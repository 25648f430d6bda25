"""``Run`` in one process (no process group): the step-boundary check, ``run.rng``, step numbering,
bad input. The multi-rank protocol is in test_run_dist.py."""

from __future__ import annotations

import json
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
    x = torch.randn(8, 4)  # the global RNG, as most examples do (DRAW-LINE)
    return x, x.sum(dim=1, keepdim=True)


def line_of(marker: str) -> int:
    """The line of this file holding ``marker`` (so the tests do not pin line numbers)."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "line_of(" not in line)


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
            batch = draw_batch()  # FIRST-DRAW
            for _step in run.steps(6):
                current = batch
                batch = draw_batch()  # prefetch: the global RNG moves before the boundary
                train(model, optimizer, run, current)
    messages = [str(w.message) for w in caught]
    assert any("between the start of the Run" in m and "torch" in m for m in messages), messages
    assert run._boundary.warnings >= 1
    # The warning is at the user's line that drew (inside draw_batch), and names the call to it.
    (warning,) = [w for w in caught if issubclass(w.category, ResumeDivergenceWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line_of("(DRAW-LINE)")), warning
    assert (f"at {__file__}:{line_of('(DRAW-LINE)')} (torch, in draw_batch(), called from "
            f"{__file__}:{line_of('# FIRST-DRAW')}") in str(warning.message), warning.message


@pytest.mark.timeout(60)
def test_a_draw_after_report_like_an_evaluation_does_not_warn_at_the_save(tmp_path):
    # The saved RNG state includes the draw, so a resume from here is bit-identical: no warning.
    # (A batch prefetched there and held is caught exactly after a resume: test_resume_check_dist.)
    model, optimizer, run = make_run(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeDivergenceWarning)
        with run:
            for _step in run.steps(4):
                train(model, optimizer, run, draw_batch())
                torch.rand(1)  # an evaluation's random draw after the step's report


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
    monkeypatch.setenv("SLURMFT_PREEMPTION_CHECK_INTERVAL_S", "30")
    model, optimizer, run = make_run(tmp_path / "run")
    with run:
        assert run.preemption is not None and run.preemption.check_every == 3
        assert run.preemption.check_interval_s == 30
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
def test_a_batch_drawn_before_the_run_is_caught_at_the_first_redone_step(tmp_path, monkeypatch):
    # The first prefetched batch drawn BEFORE `with Run` (where it lands when a loop is wrapped),
    # the next one inside the step: the restore overwrites the RNG after the draw, so no RNG check
    # sees it, and the resumed run silently differed. Step 4's inputs are step 1's: the exact check.
    run_dir = tmp_path / "run"

    def loop(total, stop_after=None):
        model, optimizer, run = make_run(run_dir, check_boundaries=False)
        batch = draw_batch()  # before the Run: from the fresh seed, not from the restored state
        with run:
            for step in run.steps(total):
                current = batch
                batch = draw_batch()  # PREFETCH
                train(model, optimizer, run, current)
                if step == stop_after:
                    break
        return run

    monkeypatch.setenv("SLURM_JOB_ID", "77")  # segments are keyed by job
    loop(6, stop_after=5)                    # checkpoint at 3, steps 4 and 5 journaled, then "killed"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the job's requeue
    with pytest.warns(ResumeDivergenceWarning, match=r"step 4, the first after the resume, trained on the "
                                                     r"inputs step 1 had") as caught:
        loop(6)
    ours = [w for w in caught if issubclass(w.category, ResumeDivergenceWarning)]
    # the user's line that draws the held batch (not slurmft's, not the loop's `for`), with its caller
    assert [(w.filename, w.lineno) for w in ours] == [(__file__, line_of("(DRAW-LINE)"))], ours
    assert f"called from {__file__}:{line_of('# PREFETCH')}" in str(ours[0].message), ours[0].message
    (diverged,) = read_events(RunDir(run_dir).events, ["resume_diverged"])
    assert (diverged.get("step"), diverged.get("cause")) == (4, "stale_inputs"), diverged.fields
    assert diverged.get("site") == f"{__file__}:{line_of('(DRAW-LINE)')}", diverged.fields
    # and `slurmft status` shows it under the segment that diverged, with the line (and in --json)
    from typer.testing import CliRunner

    from slurmft.cli import app

    result = CliRunner().invoke(app, ["status", str(run_dir), "--no-slurm"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    shown = " ".join(result.output.split())
    # the path shortened to its last two parts (a terminal 80 columns wide; --json has it whole)
    assert (f"resume diverged segment 1 (77.1): step 4 (stale_inputs) at .../unit/test_run_local.py:"
            f"{line_of('(DRAW-LINE)')}: step 4, the first after the resume") in shown, result.output
    assert "resume diverged segment 0" not in shown, result.output
    result = CliRunner().invoke(app, ["status", str(run_dir), "--no-slurm", "--json"])
    segments = json.loads(result.output)["segments"]
    assert [seg["resume_diverged"] and seg["resume_diverged"]["cause"] for seg in segments] == [None, "stale_inputs"]
    assert segments[1]["resume_diverged"]["site"] == f"{__file__}:{line_of('(DRAW-LINE)')}"


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


@pytest.mark.timeout(120)
def test_a_corrupted_newest_checkpoint_is_journaled_and_shown_by_status(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from slurmft.cli import app

    run_dir = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # segments are keyed by job

    def loop(total):
        model, optimizer, run = make_run(run_dir)
        with run:
            for _step in run.steps(total):
                train(model, optimizer, run, draw_batch())
        return run

    loop(6)  # checkpoints 3 and 6 (the final one)
    shard = next((RunDir(run_dir).checkpoint(6)).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the newest checkpoint's shard
    shard.write_bytes(bytes(data))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the job's requeue
    run = loop(8)
    assert run.restored_step == 3
    (skipped,) = read_events(RunDir(run_dir).events, ["checkpoint_skipped"])
    assert skipped.get("step") == 6 and skipped.get("reason"), skipped.fields
    result = CliRunner().invoke(app, ["status", str(run_dir), "--no-slurm"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "checkpoint skipped segment 1" in result.output and "step 6 at load" in result.output, result.output


@pytest.mark.timeout(120)
def test_a_grad_scaler_in_extras_round_trips_and_the_journal_lists_what_is_carried(tmp_path):
    # torch.amp.GradScaler("cpu") is the real object (float16 training's loss scale); its
    # scale doubles every 2 clean steps here, so a scaler that were not carried would differ.
    run_dir = tmp_path / "run"

    def loop(total, stop_after=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=2)
        run = Run(model, optimizer, run_dir=run_dir, extras={"scaler": scaler, "note": {"lr": 0.01}},
                  checkpoint=CheckpointConfig(interval=3), config=RunConfig(watchdog=False, log_every=1))
        scales = {}
        with run:
            assert run.state.extras["scaler"] is scaler  # restored in place, not replaced
            for step in run.steps(total):
                x, y = draw_batch()
                loss = F.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                if run.report(loss=loss):
                    scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                scales[step] = scaler.state_dict()
                if step == stop_after:
                    break
        return run, scaler, scales

    _, _, first = loop(6, stop_after=5)  # checkpoint 3; steps 4-5 are redone
    run, scaler, resumed = loop(6)
    assert run.restored_step == 3
    assert first[3]["scale"] == 2.0 ** 5 and first[5]["scale"] == 2.0 ** 6
    assert resumed[4] == first[4] and resumed[5] == first[5]  # it went on from step 3's scaler state
    assert run.state.extras["note"] == {"lr": 0.01}
    starts = read_events(RunDir(run_dir).events, ["segment_start"])
    assert starts[0].get("carries")["extras"] == {"scaler": "GradScaler", "note": "json"}
    assert starts[0].get("carries")["optimizer"] == "SGD" and starts[0].get("carries")["sampler"] is None


def test_a_stateful_extra_missing_from_the_checkpoint_is_named():
    from slurmft.checkpoint.state import TrainState

    class Counter:  # the state_dict contract, as GradScaler has it
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, state: dict) -> None:
            self.n = state["n"]

    counter = Counter()
    state = TrainState(torch.nn.Linear(2, 1), extras={"counter": counter})
    counter.n = 7
    saved = state.light_state(include_rng=False)
    counter.n = 0
    state._load_extras(__import__("json").loads(saved["train"]["extras"]))
    assert counter.n == 7 and state.extras["counter"] is counter
    with pytest.raises(KeyError, match=r"extras\['counter'\] \(Counter\)"):
        state._load_extras({})
