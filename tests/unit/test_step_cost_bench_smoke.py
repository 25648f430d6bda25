"""benchmarks/step_cost_bench.py at a tiny size: every row runs and ``--json`` has its keys.

This checks that the benchmark works (real gloo ranks, real journal files), not its numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "step_cost_bench.py"


@pytest.mark.timeout(120)
def test_tiny_step_cost_benchmark_prints_one_json_object(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--steps", "20", "--repeats", "1",
                           "--dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=110, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert [(r["what"], r["setting"]) for r in result["rows"]] == [
        ("preemption", "check_every=1"), ("preemption", "check_every=10"),
        ("journal loss", "durable (every event)"), ("journal loss", "buffered (defaults)")]
    assert all(r["median_us_per_step"] > 0 for r in result["rows"])
    assert list(tmp_path.iterdir()) == []  # its temp dir is gone


def test_bad_arguments_are_refused():
    proc = subprocess.run([sys.executable, str(BENCH), "--ranks", "1"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "--ranks >= 2" in proc.stderr
