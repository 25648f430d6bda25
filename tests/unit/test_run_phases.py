"""``Run`` announces its long phases in the heartbeat (issue 25): the checkpoint load before the
first step, blocking saves, a rollback's load, and a user's own ``run.phase``; the first step
boundary beats with the step's time. One process, no process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slurmft.rundir import RunDir
from slurmft.train import CheckpointConfig, Run, RunConfig
from slurmft.train import heartbeat as heartbeat_module
from slurmft.watch.runview import read_heartbeats

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURMFT_RUN_DIR")


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def written(monkeypatch):
    """Every heartbeat record as written (the file is still written)."""
    records: list[dict] = []
    real = heartbeat_module.atomic_write_json

    def spy(path, record):
        records.append(dict(record))
        real(path, record)

    monkeypatch.setattr(heartbeat_module, "atomic_write_json", spy)
    return records


def train(run_dir, total: int, *, evaluate_at: int | None = None, watchdog: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Run(model, optimizer, run_dir=run_dir, checkpoint=CheckpointConfig(interval=3),
             config=RunConfig(watchdog=watchdog, log_every=0)) as run:
        for step in run.steps(total):
            x = torch.randn(8, 4, generator=run.rng())
            loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            run.report(loss=loss)
            optimizer.step()
            optimizer.zero_grad()
            if step == evaluate_at:
                with run.phase("evaluation", bound_s=900):
                    beat = read_heartbeats(RunDir(run_dir))
                    assert beat is not None
                    node = next(iter(beat.values()))
                    assert (node.phase, node.phase_bound_s) == ("evaluation", pytest.approx(900, abs=1))
                    if run.watchdog is not None:
                        assert run.watchdog.watching == "evaluation"
    return run


@pytest.mark.timeout(120)
def test_the_load_and_the_final_save_announce_themselves_and_step_one_beats(tmp_path, written):
    run_dir = tmp_path / "run"
    train(run_dir, 3)  # a checkpoint at step 3 to load
    written.clear()
    train(run_dir, 5, evaluate_at=5, watchdog=True)
    phases = [(r.get("phase"), r["step"]) for r in written]
    # The load: announced before any step, ended before the first step's beat.
    assert phases[0] == ("checkpoint load", None) and phases[1] == (None, None)
    assert written[0]["phase_bound_s"] > 3600 and written[1]["last_step_s"] is None
    first = written[2]
    assert first["step"] == 4 and "phase" not in first and first["last_step_s"] >= 0
    # The user's evaluation and the final (blocking) save of step 5.
    assert ("evaluation", 4) in phases  # inside step 5: step 4 is the last finished
    assert ("checkpoint save of step 5", 5) in phases  # the final save, blocking
    assert phases[-1] == (None, 5)  # every phase ended with a beat that says so


@pytest.mark.timeout(60)
def test_phase_outside_a_started_run_is_an_error(tmp_path):
    model = torch.nn.Linear(4, 1)
    run = Run(model, run_dir=tmp_path / "run", config=RunConfig(watchdog=False))
    with pytest.raises(RuntimeError, match="has not started"):
        with run.phase("evaluation", bound_s=60):
            pass


@pytest.mark.parametrize("bad", [-1.0, 7200.0])
def test_a_heartbeat_interval_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        RunConfig(heartbeat_interval_s=bad)


def test_the_slow_storage_knob_for_tests_parses_and_refuses_bad_input(monkeypatch):
    from slurmft.checkpoint.writer import FAULT_SLOW_ENV, FaultPlan

    monkeypatch.setenv(FAULT_SLOW_ENV, "load@4=65, write=1.5")
    assert FaultPlan.from_env().slow == (("load", 4, 65.0), ("write", None, 1.5))
    for bad in ("load@x=1", "nowhere=1", "write=-1", "write"):
        monkeypatch.setenv(FAULT_SLOW_ENV, bad)
        with pytest.raises(ValueError, match=FAULT_SLOW_ENV):
            FaultPlan.from_env()
