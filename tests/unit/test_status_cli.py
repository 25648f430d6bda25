"""``slurmft status`` on a run dir: the table, ``--json``, ``--plot``, and one clear line (exit
2) for bad input. A JOBID is looked up in Slurm: tests/integration/test_status_slurm.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slurmft.cli import app

pytestmark = pytest.mark.timeout(120)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "journal" / "preempt_crash.events.jsonl"


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(FIXTURE, run / "events.jsonl")
    return run


def invoke(*args):
    return CliRunner().invoke(app, ["status", *map(str, args)], env={"COLUMNS": "200"})


def test_json_is_one_object_with_the_report(run_dir):
    result = invoke(run_dir, "--json", "--no-slurm")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["run_dir"] == str(run_dir.resolve()) and data["restarts"] == 2
    assert [f["cause"] for f in data["faults"]] == ["preempted", "crash"]
    assert data["restarts_by_cause"] == {"crash": 1, "preempted": 1}
    assert 0 < data["ettr"] < 1 and data["slurm"] is None


def test_table_names_the_state_the_faults_and_the_segments(run_dir):
    result = invoke(run_dir, "--no-slurm")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("finished (COMPLETED, exit 0)", "ETTR", "crash 1; planned: preempted 1", "REQUEUE (85)",
                 "killed (no end recorded)", "24->20", "signal 9", "checkpoint_overdue"):
        assert text in out, text


def test_plot_writes_a_png(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    result = invoke(run_dir, "--no-slurm", "--plot", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_plot_without_matplotlib_is_one_line(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = invoke(run_dir, "--no-slurm", "--plot", tmp_path / "t.png")
    assert result.exit_code == 2
    assert result.output.strip() == ("slurmft status: --plot needs matplotlib, which is not "
                                     "installed: pip install 'slurmft[plot]'")
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("target,extra,message", [
    ("{tmp}", [], "{tmp} is not a slurmft run dir (it has no events.jsonl)"),
    ("{tmp}/nope", [], "run dir {tmp}/nope is not a directory"),
    ("12ab", [], "'12ab' is neither a job id nor a run directory"),
    ("{run}", ["--plot", "{tmp}/t.svg"], "--plot {tmp}/t.svg: the file name must end in .png"),
    ("{run}", ["--plot", "{tmp}/no/t.png"], "--plot {tmp}/no/t.png: its directory does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(run_dir, tmp_path, target, extra, message):
    fill = lambda s: s.format(tmp=tmp_path, run=run_dir)  # noqa: E731
    result = invoke(fill(target), "--no-slurm", *map(fill, extra))
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"slurmft status: {fill(message)}"


def test_a_journal_that_is_a_symlink_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").symlink_to(FIXTURE)
    result = invoke(run, "--no-slurm")
    assert result.exit_code == 2 and "cannot read the run's journal" in result.output


def test_the_watchers_saved_state_is_read_from_the_run_dir(run_dir):
    from slurmft.rundir import RunDir
    from slurmft.watch.state import RunState, save_state

    save_state(RunDir(run_dir), RunState(job_id="1", phase="finished", restarts=2))
    data = json.loads(invoke(run_dir, "--json", "--no-slurm").stdout)
    assert data["watcher"] == {"phase": "finished", "restarts": 2, "reason": ""}
    assert "finished, 2 restarts (its saved state" in invoke(run_dir, "--no-slurm").stdout
