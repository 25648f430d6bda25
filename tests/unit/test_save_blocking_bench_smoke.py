"""benchmarks/save_blocking_bench.py at a tiny size: every size runs and ``--json`` has its keys.

This checks that the benchmark works (a real FSDP2 model, real saves), not its numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "save_blocking_bench.py"


@pytest.mark.timeout(120)
def test_tiny_save_blocking_benchmark_prints_one_json_object(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--layers", "1", "3", "--saves", "2", "--json"],
                          capture_output=True, text=True, timeout=110, cwd=REPO,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert [(r["layers"], r["parameters"]) for r in result["rows"]] == [(1, 2), (3, 6)]
    for row in result["rows"]:
        assert row["committed_saves"] == 3, row   # every save committed, the first included
        assert 0 < row["blocking_ms_min"] <= row["blocking_ms_median"], row
        assert row["get_state_dict_ms_median"] > 0, row
    assert list(tmp_path.glob("slurmft-save-blocking-*")) == []  # its temp dir is gone


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--saves", "0"], ["--width", "-1"]])
def test_bad_arguments_are_refused_before_anything_starts(argv, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the module puts the repo first: undone after
    spec = importlib.util.spec_from_file_location("save_blocking_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert "--layers, --width and --saves must be >= 1" in capsys.readouterr().err
