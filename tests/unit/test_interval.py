"""``slurmft interval``: Young's and Daly's formulas, inputs measured from a run dir (a constructed
journal and the captured one), and one clear line (exit 2) for every bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slurmft.cli import app
from slurmft.interval import IntervalError, compute, daly, young
from slurmft.journal import Journal

pytestmark = pytest.mark.timeout(60)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "journal" / "preempt_crash.events.jsonl"


def invoke(*args):
    return CliRunner().invoke(app, ["interval", *map(str, args)])


def test_young_and_daly_by_hand():
    # C = 60 s, M = 24 h: sqrt(2 * 60 * 86400) = 3220.0 s.
    assert young(60, 86400) == pytest.approx(3219.94, abs=0.01)
    r = 60 / (2 * 86400)
    assert daly(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400) * (1 + math.sqrt(r) / 3 + r / 9) - 60)
    assert daly(60, 86400) < young(60, 86400)  # the -C term dominates when C << M
    assert daly(100, 50) == 50 and daly(100, 49.9) == 49.9  # C >= 2M: checkpoint once per MTBF


def test_node_count_times_per_node_mtbf():
    got = compute(cost_s=30, mtbf_s=None, nodes=512, node_mtbf_s=1e7, step_s=2)
    assert got.mtbf_s == pytest.approx(1e7 / 512)
    assert got.young_s == pytest.approx(math.sqrt(2 * 30 * 1e7 / 512))
    assert got.steps(got.young_s) == round(got.young_s / 2)


def _run(tmp_path) -> Path:
    """A constructed run: 4 saves blocking 1, 2, 3, 2 s; 2 crashes and a preemption; 1 s steps."""
    run = tmp_path / "run"
    seg = Journal(run, job_id="7", restart_count=0)
    seg.append("segment_start", world_size=8, num_nodes=4, nodelist="n[1-4]", restored_step=None)
    for i, blocking in enumerate((1.0, 2.0, 3.0, 2.0)):
        seg.append("checkpoint_committed", step=i, blocking_s=blocking)
    for restart, end in ((0, 1), (1, 85), (2, 1)):
        seg = Journal(run, job_id="7", restart_count=restart)
        if restart:
            seg.append("segment_start", world_size=8, num_nodes=4, nodelist="n[1-4]", restored_step=0)
        seg.append("segment_end", exit_code=end, outcome="x", reason="y")
    return run


def test_measured_from_a_run_dir(tmp_path):
    run = _run(tmp_path)
    result = invoke("--run-dir", run, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["cost_s"] == 2.0 and "4 saves" in data["cost_from"]
    # The last segment ended with exit 1 and nothing after it: it is a fault too. Faults: crash,
    # preempted (not a failure: it saved first), crash -> 2 failures over the run's wall time.
    assert data["mtbf_from"].startswith("2 failures in ")
    assert data["step_s"] is None and data["young_steps"] is None
    node = json.loads(invoke("--run-dir", run, "--node-mtbf", "4000", "--json").stdout)
    assert node["mtbf_s"] == 1000 and node["mtbf_from"].startswith("4 nodes of the run")


def test_measured_from_the_captured_journal(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(FIXTURE, run / "events.jsonl")
    result = invoke("--run-dir", run, "--json")
    data = json.loads(result.stdout)
    assert data["mtbf_from"].startswith("1 failures in ")  # the crash; the preemption saved first
    assert 0 < data["cost_s"] < 1 and 0.1 < data["step_s"] < 2
    assert data["young_steps"] == max(1, round(data["young_s"] / data["step_s"]))
    text = invoke("--run-dir", run)
    assert "Young" in text.stdout and "Daly" in text.stdout and "steps at" in text.stdout


@pytest.mark.parametrize("args,message", [
    (["--mtbf", "100"], "no checkpoint cost: give --cost SECONDS or --run-dir DIR"),
    (["--cost", "10"], "no MTBF: give --mtbf SECONDS, --nodes N --node-mtbf SECONDS, or --run-dir DIR"),
    (["--cost", "0", "--mtbf", "100"], "--cost must be a positive number of seconds, got 0.0"),
    (["--cost", "10", "--mtbf", "-5"], "--mtbf must be a positive number of seconds, got -5.0"),
    (["--cost", "nan", "--mtbf", "5"], "--cost must be a positive number of seconds, got nan"),
    (["--cost", "10", "--mtbf", "inf"], "--mtbf must be a positive number of seconds, got inf"),
    (["--cost", "10", "--nodes", "0", "--node-mtbf", "5"], "--nodes must be a whole number >= 1, got 0"),
    (["--cost", "10", "--nodes", "8"], "--nodes needs --node-mtbf"),
    (["--cost", "10", "--node-mtbf", "8"], "--node-mtbf needs --nodes"),
    (["--cost", "10", "--mtbf", "5", "--nodes", "8", "--node-mtbf", "5"], "give either --mtbf, or"),
    (["--cost", "1", "--mtbf", "5", "--step-time", "0"], "--step-time must be a positive number"),
    (["--run-dir", "{tmp}"], "--run-dir {tmp} is not a slurmft run dir (it has no events.jsonl)"),
    (["--run-dir", "{tmp}/nope"], "--run-dir {tmp}/nope is not a directory"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    result = invoke(*(a.format(tmp=tmp_path) for a in args))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slurmft interval: ")
    assert message.format(tmp=tmp_path) in lines[0]


def test_a_run_without_failures_or_saves_says_what_to_give(tmp_path):
    run = tmp_path / "run"
    Journal(run, job_id="7", restart_count=0).append("segment_start", world_size=1, restored_step=None)
    assert "no checkpoint_committed event" in invoke("--run-dir", run).output
    assert "shows no failure" in invoke("--run-dir", run, "--cost", "3").output
    with pytest.raises(IntervalError):
        compute(cost_s=True, mtbf_s=5, nodes=None, node_mtbf_s=None)
