"""restart_phases: what a (re)start of the ranks cost, journaled by ``Run`` at the end of each
segment's first step; the process's start time read from /proc."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from slurmft import journal
from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.train import CheckpointConfig, Run, RunConfig
from slurmft.train.phases import process_start_time

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURMFT_RUN_DIR",
            "TORCHELASTIC_RESTART_COUNT")
PHASES = ("process_start", "torch_imported", "run_started", "checkpoint_loaded", "first_step_done")


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)


def test_a_child_reads_its_own_start_between_its_spawn_and_its_answer():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from slurmft.train.phases import process_start_time; "
                          "import time; print(process_start_time(), time.time())"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    started, answered = float(out[0]), float(out[1])
    # starttime counts whole clock ticks (10 ms): it may read up to one tick early.
    assert before - 0.02 <= started <= answered


def test_a_command_name_with_parentheses_and_spaces_does_not_shift_the_fields(tmp_path):
    real = open("/proc/self/stat").read()
    pid, rest = real.split(" (", 1)
    odd = tmp_path / "stat"
    odd.write_text(f"{pid} (py) (x y) {rest.split(') ', 1)[1]}")
    here = process_start_time()
    assert here is not None and process_start_time(str(odd)) == pytest.approx(here, abs=0.05)


@pytest.mark.parametrize("text", ["", "12 (python) S 1", "garbage without parens"])
def test_an_unreadable_stat_is_none(tmp_path, text):
    bad = tmp_path / "stat"
    bad.write_text(text)
    assert process_start_time(str(bad)) is None
    assert process_start_time(str(tmp_path / "missing")) is None


def segment(run_dir, total: int, attempt: int, monkeypatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Run(model, optimizer, run_dir=run_dir, checkpoint=CheckpointConfig(interval=3),
             config=RunConfig(watchdog=False, log_every=1)) as run:
        for step in run.steps(total):
            x = torch.randn(8, 4, generator=run.rng())
            loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            run.report(loss=loss)
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.timeout(120)
def test_each_segment_journals_its_phases_once_in_order_with_the_tier_it_loaded(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    segment(run_dir, 4, 0, monkeypatch)   # fresh start; saves 3 and 4
    segment(run_dir, 6, 1, monkeypatch)   # torchrun's next attempt: restores 4
    events = read_events(RunDir(run_dir).events, [journal.RESTART_PHASES])
    assert [(e.get("attempt"), e.get("step"), e.get("restored_step"), e.get("tier")) for e in events] == [
        (0, 1, None, None), (1, 5, 4, "shared")]
    for event in events:
        times = [event.get(name) for name in PHASES]
        assert all(isinstance(t, float) for t in times), event.fields
        assert times == sorted(times), event.fields
        assert event.get("total_s") == pytest.approx(times[-1] - times[0], abs=1e-5)
        parts = sum(event.get(k) for k in ("import_s", "setup_s", "load_s", "first_step_s"))
        assert parts == pytest.approx(event.get("total_s"), abs=1e-5)
        assert event.get("world_size") == 1
    # This test process started long before either segment: its process_start is the same.
    assert events[0].get("process_start") == pytest.approx(events[1].get("process_start"), abs=0.02)
