"""The benchmarks refuse a bad argument or setting in one line naming it, before they run anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.parametrize("args, named", [
    (["--budget-s", "-1"], "--budget-s"), (["--budget-s", "nan"], "--budget-s"),
    (["--size-gb", "0"], "--size-gb"), (["--size-gb", "inf"], "--size-gb"), (["--only", "nvml,bogus"], "bogus"),
])
def test_a_bad_argument_is_refused_in_one_line_naming_it(args, named, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert named in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()   # nothing written on the way


LOAD_BENCH = SCRIPT.parent / "load_bench.py"


@pytest.mark.parametrize("env, tree, named", [
    ({"SIZE": "x"}, "repo", "SIZE"), ({"SIZE": "-1"}, "repo", "SIZE"), ({"DEV": "tpu"}, "repo", "DEV"),
    ({}, "missing", "no slurmft package"),
])
def test_load_bench_refuses_a_bad_setting_in_one_line_naming_it(env, tree, named, tmp_path):
    import os

    where = str(SCRIPT.parents[1]) if tree == "repo" else str(tmp_path / "missing")
    done = subprocess.run([sys.executable, str(LOAD_BENCH), where, "load", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert done.returncode == 2, done.stdout + done.stderr
    assert named in done.stderr.strip().splitlines()[-1]
