"""A draw between ``with Run(...)`` and the loop that the first step does not read but a later one
does (review30 finding 1 on issue 30): an evaluation before the loop on the global RNG, batches
from ``run.rng(step)``, and an augmentation from the global RNG every 4th step. Resumed after a
preemption the run differs from step 8 on; the check must say so at step 8 (and a fresh start
warn at step 4), while the same loop without the augmentation (bit for bit) gets no warning."""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch
import torch.nn.functional as F

from slurmft import exitcodes
from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.train import CheckpointConfig, GuardConfig, ResumeDivergenceWarning, Run, RunConfig

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURMFT_RUN_DIR",
            "SLURM_RESTART_COUNT")


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "9")  # segments are keyed by job


def line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "line_of(" not in line)


def loop(run_dir, *, augment: bool, signal_at: int | None = None, nan_at: int | None = None) -> dict[int, float]:
    """The review's loop (/work/reports/review30_late_draw.py); the losses by step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses: dict[int, float] = {}
    with Run(model, optimizer, run_dir=run_dir, checkpoint=CheckpointConfig(interval=3),
             guards=GuardConfig(action="rollback"), config=RunConfig(watchdog=False, log_every=1)) as run:
        with torch.no_grad():
            model(torch.randn(16, 4))  # an evaluation before the loop, global RNG (EVAL-BEFORE)
        for step in run.steps(12):
            x = torch.randn(8, 4, generator=run.rng(step))
            if augment and step % 4 == 0:
                x = x + 0.1 * torch.randn(8, 4)  # every 4th step, global RNG (AUGMENT)
            loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            if step == nan_at:
                nan_at = None  # once: the replayed step is fine
                loss = loss * float("nan")
            run.report(loss=loss)
            optimizer.step()
            optimizer.zero_grad()
            losses[step] = float(run.loss)
            if step == signal_at:
                os.kill(os.getpid(), signal.SIGUSR2)  # a preemption
    return losses


def ours(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, ResumeDivergenceWarning)]


def preempted_and_resumed(run_dir, monkeypatch, augment: bool, nan_at: int | None = None
                          ) -> tuple[dict[int, float], list]:
    with pytest.raises(SystemExit) as ended, warnings.catch_warnings(record=True):
        warnings.simplefilter("always")  # a fresh start: the first test asserts its warning
        loop(run_dir, augment=augment, signal_at=5)
    assert ended.value.code == exitcodes.REQUEUE
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = loop(run_dir, augment=augment, nan_at=nan_at)
    return resumed, ours(caught)


@pytest.mark.timeout(120)
def test_a_draw_before_the_loop_that_step_8_reads_is_reported_at_step_8(tmp_path, monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = loop(tmp_path / "ref", augment=True)
    (fresh,) = ours(caught)  # a fresh start: warned once, at the evaluation, when step 4 reads it
    assert (fresh.filename, fresh.lineno) == (__file__, line_of("(EVAL-BEFORE)")), fresh
    assert "Step 4 is the first step that draws from it." in str(fresh.message), fresh.message

    run_dir = tmp_path / "run"
    resumed, warned = preempted_and_resumed(run_dir, monkeypatch, augment=True)
    first = min(resumed)
    assert first < 8
    # the finding is real: the resumed run equals the uninterrupted one up to step 7, not after
    assert all(resumed[s] == reference[s] for s in range(first, 8)), (resumed, reference)
    assert resumed[8] != reference[8], (resumed, reference)
    (diverged,) = read_events(RunDir(run_dir).events, ["resume_diverged"])
    assert (diverged.get("step"), diverged.get("cause")) == (8, "rng_before_loop"), diverged.fields
    assert diverged.get("site") == f"{__file__}:{line_of('(EVAL-BEFORE)')}", diverged.fields
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, line_of("(EVAL-BEFORE)"))], warned
    message = str(warned[0].message)
    assert "resume diverged at step 8:" in message, message
    assert "Step 8 is the first step that draws from that random state" in message, message


@pytest.mark.timeout(120)
def test_a_draw_before_the_loop_that_no_step_reads_is_not_reported(tmp_path, monkeypatch):
    # the false alarm 36e3166 fixed stays fixed with the verdict held open past step 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = loop(tmp_path / "ref", augment=False)
    assert ours(caught) == []
    run_dir = tmp_path / "run"
    resumed, warned = preempted_and_resumed(run_dir, monkeypatch, augment=False)
    assert warned == []
    assert read_events(RunDir(run_dir).events, ["resume_diverged"]) == []
    assert all(resumed[s] == reference[s] for s in resumed), (resumed, reference)


@pytest.mark.timeout(120)
def test_a_rollback_to_the_restored_checkpoint_does_not_count_as_a_draw(tmp_path, monkeypatch):
    # The held verdict compares the moved generators with their state at the loop's start; a guard
    # rollback to the checkpoint the segment restored puts back the state from before the window's
    # draw, which is no step drawing (nothing is read from the global RNG here): no warning.
    run_dir = tmp_path / "run"
    resumed, warned = preempted_and_resumed(run_dir, monkeypatch, augment=False, nan_at=8)
    (rollback,) = read_events(RunDir(run_dir).events, ["rollback"])
    restored = min(resumed) - 1
    assert (rollback.get("from_step"), rollback.get("to_step")) == (8, restored), rollback.fields
    assert warned == []
    assert read_events(RunDir(run_dir).events, ["resume_diverged"]) == []
