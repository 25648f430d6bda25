"""benchmarks/watch_scale_bench.py's live part at a tiny size, on the devcluster it brings up:
one ``--all`` watcher over 3 real run dirs with beating writers and 3 held jobs; the counts it
prints are the ones the README reports at 1,000 runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "watch_scale_bench.py"


def test_tiny_live_run_counts_what_an_idle_cycle_costs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--skip-replay", "--runs", "3", "--nodes-per-run", "2",
         "--cycles", "2", "--spacing-s", "0", "--memory-cycles", "20", "--beat-s", "5",
         "--dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=560, cwd=REPO)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert proc.stdout.startswith("{"), proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    live = result["live"]
    assert live["first_cycle"]["runs_watched"] == 3
    assert result["cycle_queries_1000_runs"] == 1.0  # held jobs: one squeue, no node table
    assert 0 < result["fs_ops_per_idle_run_cycle"] <= 3
    assert live["idle"]["bytes_read_per_run_cycle"] == 0
    assert result["memory_growth_ratio"] is not None and live["memory"]["cycles"] == 20
    assert list(tmp_path.iterdir()) == []  # the benchmark removed its cluster and run dirs
