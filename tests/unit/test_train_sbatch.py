"""The sbatch template agrees with the Python side and refuses bad input before touching Slurm."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from slurmft import exitcodes, rundir

TEMPLATE = Path(__file__).resolve().parents[2] / "sbatch_templates" / "train.sbatch"


def _assignment(name):
    match = re.search(rf"^{name}=(\S+)$", TEMPLATE.read_text(), re.M)
    assert match, f"{name}= not found in {TEMPLATE}"
    return match.group(1)


def test_template_uses_the_python_exit_codes_and_done_name():
    assert int(_assignment("EXIT_REQUEUE")) == exitcodes.REQUEUE
    assert int(_assignment("EXIT_NO_REQUEUE")) == exitcodes.NO_REQUEUE
    assert _assignment("DONE_NAME") == rundir.DONE


def test_template_asks_slurm_for_requeue_append_and_a_usr2_warning():
    directives = re.findall(r"^#SBATCH (\S+)", TEMPLATE.read_text(), re.M)
    assert "--requeue" in directives and "--open-mode=append" in directives
    assert any(re.fullmatch(r"--signal=B:USR2@\d+", d) for d in directives)


def test_template_is_valid_bash():
    subprocess.run(["bash", "-n", str(TEMPLATE)], check=True, timeout=10)


def _run(tmp_path, env_extra, args=()):
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "123", "SLURM_JOB_NUM_NODES": "1",
           "SLURMFT_PYTHON": os.environ.get("PYTHON", "python3"), **env_extra}
    return subprocess.run(["bash", str(TEMPLATE), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("env_extra, args, needle", [
    ({}, ["train.py"], "SLURMFT_RUN_DIR is not set"),
    ({"SLURMFT_RUN_DIR": "relative/dir"}, ["train.py"], "must be an absolute path"),
    ({"SLURMFT_RUN_DIR": "/tmp/x", "SLURMFT_PYTHON": "/nonexistent/python"}, ["train.py"],
     "is not an executable"),
    ({"SLURMFT_RUN_DIR": "{tmp}/run"}, [], "no training command"),
    ({"SLURMFT_RUN_DIR": "{tmp}/run"}, ["missing.py"], "training script missing.py does not exist"),
    ({"SLURMFT_RUN_DIR": "{tmp}/run", "SLURMFT_NPROC_PER_NODE": "two"}, ["-m", "x"],
     "SLURMFT_NPROC_PER_NODE=two must be a positive integer"),
])
def test_bad_input_exits_do_not_requeue_with_one_clear_line(tmp_path, env_extra, args, needle):
    env_extra = {k: v.replace("{tmp}", str(tmp_path)) for k, v in env_extra.items()}
    if "SLURMFT_PYTHON" not in env_extra:
        env_extra["SLURMFT_PYTHON"] = str(Path(os.sys.executable))
    proc = _run(tmp_path, env_extra, args)
    assert proc.returncode == exitcodes.NO_REQUEUE, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    run = tmp_path / "run"
    if run.exists():  # the reason is journaled when the run dir is known
        from slurmft.journal import read_events
        events = read_events(run / "events.jsonl")
        assert events[-1].get("action") == "give_up" and needle in events[-1].get("reason")
