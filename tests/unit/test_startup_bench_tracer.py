"""The start-up phase tracer of ``benchmarks/startup_bench.py`` (``benchmarks/phase_trace/``) in a
real Python process: the marks it writes, their order, and the bench's reading of them. Checks
that the tool works, not any time."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACER = REPO / "benchmarks" / "phase_trace"

CHILD = """
import subprocess, torch, torch.distributed as dist
import slurmft.checkpoint.loading
subprocess.run(["true"], check=True)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.destroy_process_group()
"""


def bench_module():
    spec = importlib.util.spec_from_file_location("startup_bench", REPO / "benchmarks" / "startup_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_child(tmp_path: Path, trace: bool) -> Path:
    out = tmp_path / "trace"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SLURMFT_PHASE_TRACE"}
    env["PYTHONPATH"] = os.pathsep.join([str(TRACER), str(REPO)])
    env["SLURMD_NODENAME"] = "n7"
    env["SLURM_RESTART_COUNT"] = "2"
    if trace:
        env["SLURMFT_PHASE_TRACE"] = str(out)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.timeout(180)
def test_every_mark_is_written_once_in_the_order_the_process_reached_it(tmp_path):
    before = time.time()
    out = run_child(tmp_path, trace=True)
    after = time.time()
    [path] = out.iterdir()
    assert path.name.startswith("n7.") and path.suffix == ".jsonl"
    (proc,) = bench_module().read_traces(out)
    assert proc["node"] == "n7" and proc["restart"] == 2
    marks = proc["marks"]
    order = ["process_start", "interpreter_ready", "torch_imported", "init_process_group:begin",
             "init_process_group:end", "process_exit"]
    assert [marks[m] for m in order] == sorted(marks[m] for m in order)
    # the process start comes from /proc at 10 ms precision: inside the run, not a second early
    assert before - 0.05 <= marks["process_start"] <= marks["interpreter_ready"] <= after
    assert "popen#0" not in marks  # only srun is counted as a step; `true` is not


def test_without_the_variable_nothing_is_written(tmp_path):
    out = run_child(tmp_path, trace=False)
    assert list(out.iterdir()) == []


def test_the_preflights_sweep_is_told_apart_by_its_argv():
    """The process the pre-flight starts for the sweep (its argv as ``nodecheck`` builds it) is
    the bench's "sweep", not "preflight": its started/done rows would be empty otherwise."""
    from slurmft.launch import nodecheck

    seen: list[list[str]] = []

    def run(argv, timeout):
        seen.append(argv)
        return 0, '{"node": "n1", "results": []}', ""

    nodecheck.sweep_lines("n1", sys.executable, time.monotonic() + 60, 5, 300, run=run)
    bench = bench_module()
    [argv] = seen
    assert bench.role({"argv": argv}) == "sweep"
    assert bench.role({"argv": [sys.executable, "-m", "slurmft.launch.nodecheck", "x"]}) == "preflight"
