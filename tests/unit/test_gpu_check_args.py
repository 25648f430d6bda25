"""benchmarks/gpu_check.py refuses a bad argument in one line naming it, before it runs anything."""

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
