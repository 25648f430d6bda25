"""benchmarks/watch_scale_bench.py at a tiny size: the replay part runs the real decision code
and prints one JSON object with its keys (the live part, which brings up a devcluster, is
checked by tests/integration/test_watch_scale_bench.py). This checks the benchmark works, not
its numbers: the real run is ``python benchmarks/watch_scale_bench.py``, reported in the README."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "watch_scale_bench.py"


@pytest.mark.timeout(300)
def test_tiny_replay_prints_one_json_object(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--skip-live", "--replay-days", "0.02", "--replay-ends", "1",
         "--replay-processes", "1", "--dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=280, cwd=REPO)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a target missed, said on stderr
    assert proc.stdout.startswith("{"), proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["replay_days"] == 0.02 and result["replay_runs"] == 4
    assert abs(result["replay_cycles"] - 0.02 * 86400 / 5) <= 1  # one per poll (5 s)
    assert isinstance(result["replay_actions_healthy"], int)
    assert (proc.returncode == 1) == (result["replay_actions_healthy"] > 0)
    assert len(result["replay_action_details"]) == min(result["replay_actions_healthy"], 20)
    assert result["replay_planned_ends"] >= 4  # every run reached its time limit once
