"""Run-dir layout and atomic writes."""

import json
import os

import pytest

from slurmft.rundir import RunDir, atomic_write_json, parse_step_dirname, read_json, step_dirname


def test_step_names_sort_numerically():
    names = [step_dirname(s) for s in (5, 1200, 40)]
    assert sorted(names) == [step_dirname(5), step_dirname(40), step_dirname(1200)]
    assert parse_step_dirname(step_dirname(1200)) == 1200
    assert parse_step_dirname("step_000001200.tmp-abc") is None
    assert parse_step_dirname("manifest.json") is None
    with pytest.raises(ValueError):
        step_dirname(-1)


def test_committed_steps_ignore_tmp(tmp_path):
    run = RunDir(tmp_path)
    run.checkpoint(3).mkdir(parents=True)
    run.checkpoint(10).mkdir(parents=True)
    (run.checkpoints / (step_dirname(11) + ".tmp-x")).mkdir()
    assert run.committed_steps() == [3, 10]


def test_atomic_write_leaves_no_temp(tmp_path):
    target = tmp_path / "a" / "state.json"
    atomic_write_json(target, {"x": 1})
    atomic_write_json(target, {"x": 2})
    assert read_json(target) == {"x": 2}
    assert os.listdir(target.parent) == ["state.json"]


def test_atomic_write_failure_keeps_old(tmp_path):
    target = tmp_path / "state.json"
    atomic_write_json(target, {"x": 1})
    with pytest.raises(TypeError):
        atomic_write_json(target, {"x": object()})
    assert read_json(target) == {"x": 1}
    assert os.listdir(tmp_path) == ["state.json"]


def test_rundir_accepts_a_string(tmp_path):
    assert RunDir(str(tmp_path)).checkpoints == tmp_path / "checkpoints"


def test_done_names_the_job_and_step_it_belongs_to(tmp_path):
    from slurmft.rundir import Done, read_done, write_done

    run = RunDir(tmp_path)
    assert read_done(run) is None
    write_done(run, job_id="104_1", step=40, total_steps=40, restart_count=2)
    assert read_done(run) == Done(job_id="104_1", step=40, total_steps=40, restart_count=2)
    assert json.loads(run.done.read_text())["version"] == 1


def test_done_reader_takes_the_older_text_marker_and_refuses_special_files(tmp_path):
    from slurmft.rundir import Done, read_done

    run = RunDir(tmp_path)
    run.done.write_text("1200\n")
    assert read_done(run) == Done(job_id=None, step=1200, total_steps=None)
    run.done.write_text("[" * 100000)
    assert read_done(run) == Done(job_id=None, step=None, total_steps=None)
    run.done.unlink()
    os.mkfifo(run.done)
    assert read_done(run) is None   # never blocks on a FIFO
    run.done.unlink()
    (tmp_path / "elsewhere").write_text('{"job_id": "9"}')
    run.done.symlink_to(tmp_path / "elsewhere")
    assert read_done(run) is None   # never follows a link
