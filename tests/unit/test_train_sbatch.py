"""The sbatch template is short (#SBATCH lines, NCCL env, one exec of the launcher) and bad input
is refused with one clear line and "do not requeue" before anything touches Slurm."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch_envs import recorded
from slurmft import exitcodes

pytestmark = pytest.mark.timeout(60)
TEMPLATE = Path(__file__).resolve().parents[2] / "sbatch_templates" / "train.sbatch"


def test_template_asks_slurm_for_requeue_append_and_a_usr2_warning():
    directives = re.findall(r"^#SBATCH (\S+)", TEMPLATE.read_text(), re.M)
    assert "--requeue" in directives and "--open-mode=append" in directives
    assert any(re.fullmatch(r"--signal=B:USR2@\d+", d) for d in directives)


def test_template_is_one_exec_of_the_launcher_and_calls_no_slurm_command():
    code = [l for l in TEMPLATE.read_text().splitlines() if l.strip() and not l.lstrip().startswith("#")]
    assert sum(1 for l in code if l.startswith("exec ")) == 1
    assert code[-1] == 'exec "$PYTHON" -m slurmft.launch "$@"'
    assert not any(re.search(r"\b(srun|scontrol|scancel|squeue|sbatch)\b", l) for l in code)


def test_template_is_valid_bash():
    subprocess.run(["bash", "-n", str(TEMPLATE)], check=True, timeout=10)


def _run(tmp_path, env_extra, args=()):
    env = {"PATH": os.environ["PATH"], **recorded("nonarray"), "SLURMFT_PYTHON": sys.executable,
           **env_extra}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run(["bash", str(TEMPLATE), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=50)


@pytest.mark.parametrize("env_extra, args, needle", [
    ({}, ["train.py"], "SLURMFT_RUN_DIR is not set"),
    ({"SLURM_JOB_ID": None}, ["train.py"], "SLURM_JOB_ID is not set: not inside a Slurm job"),
    ({"SLURMFT_RUN_DIR": "relative/dir"}, ["train.py"], "must be an absolute path"),
    ({"SLURMFT_RUN_DIR": "{tmp}/run"}, [], "no training command"),
    ({"SLURMFT_RUN_DIR": "{tmp}/run"}, ["missing.py"], "training script missing.py does not exist"),
    ({"SLURMFT_RUN_DIR": "{tmp}/run", "SLURMFT_NPROC_PER_NODE": "two"}, ["-m", "x"],
     "SLURMFT_NPROC_PER_NODE='two' must be an integer"),
    ({"SLURMFT_RUN_DIR": "{tmp}/run", "SLURMFT_RESIGNAL_S": "abc"}, ["-m", "x"],
     "SLURMFT_RESIGNAL_S='abc' must be a number"),
    ({"SLURMFT_RUN_DIR": "{tmp}/file"}, ["-m", "x"], "it is not a directory"),
    ({"SLURMFT_HET_SIZE": None, **recorded("hetjob"), "SLURMFT_RUN_DIR": "{tmp}/run"}, ["-m", "x"],
     "heterogeneous jobs are not supported"),
])
def test_bad_input_exits_do_not_requeue_with_one_clear_line(tmp_path, env_extra, args, needle):
    (tmp_path / "file").write_text("not a directory\n")
    env_extra = {k: v.replace("{tmp}", str(tmp_path)) if v else v for k, v in env_extra.items()}
    proc = _run(tmp_path, env_extra, args)
    assert proc.returncode == exitcodes.NO_REQUEUE, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    run = tmp_path / "run"
    if run.exists():  # the reason is journaled when the run dir is known
        from slurmft.journal import read_events
        events = read_events(run / "events.jsonl")
        assert events[-1].get("action") == "give_up" and needle in events[-1].get("reason")


def test_a_python_missing_on_the_node_is_passed_on_never_86(tmp_path):
    # A missing tool is not a deliberate "do not requeue": the watcher retries it (bounded).
    proc = _run(tmp_path, {"SLURMFT_RUN_DIR": "/tmp/x", "SLURMFT_PYTHON": "/nonexistent/python"},
                ["train.py"])
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "SLURMFT_PYTHON=/nonexistent/python is not an executable" in errors[0]


@pytest.mark.parametrize("err, node_trouble", [(5, True), (2, True), (30, True), (13, True)])
def test_a_run_dir_this_node_cannot_reach_is_node_trouble(monkeypatch, tmp_path, err, node_trouble):
    from slurmft.launch import main as launch_main

    def refuse(path, exist_ok=False):
        raise OSError(err, os.strerror(err), path)

    monkeypatch.setattr(launch_main.os, "makedirs", refuse)
    reason, trouble = launch_main.check_run_dir_here(str(tmp_path / "run"))
    assert trouble is node_trouble and "cannot create it" in reason
