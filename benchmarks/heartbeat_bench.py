"""Heartbeat cost per training step, for steps of given lengths at a given cadence.

``Heartbeat.beat(step)`` is called at every step boundary; it writes (one atomic JSON replace:
temp file, fsync, rename, fsync dir) at the segment's first step and then at the first boundary
``interval_s`` seconds after the last write, so a step of ``s`` seconds writes once every
``ceil(interval_s / s)`` steps (every step when ``s >= interval_s``). Measured: the median over
repeats of a boundary that does not write (the clock check) and of one that writes; the cost per
step is the first plus the second divided by the steps between writes. A phase (``with
heartbeat.phase(...)``) costs two writes. Run it on the filesystem that will hold the run
directory (``--dir``): on a shared filesystem the fsyncs dominate. Prints a table, or one JSON
object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from slurmft.rundir import RunDir
from slurmft.train.heartbeat import Heartbeat


def _median_us(samples: list[float], calls: int) -> float:
    return statistics.median(samples) / calls * 1e6


def measure(directory: Path, calls: int, repeats: int) -> dict[str, float]:
    """Microseconds per boundary that does not write, per write, per phase (two writes)."""
    check, write, phase = [], [], []
    for r in range(repeats):
        hb = Heartbeat(RunDir(directory), f"bench{r}", job_id="0", restart_count=0, interval_s=1e9)
        hb.beat(0)  # the segment's first boundary writes; the rest are checks
        t0 = time.perf_counter()
        for step in range(1, calls + 1):
            hb.beat(step)
        check.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for step in range(1, calls + 1):
            hb.beat(step, force=True)
        write.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(max(calls // 10, 1)):
            with hb.phase("checkpoint save", bound_s=3660):
                pass
        phase.append(time.perf_counter() - t0)
    return {"check_us": _median_us(check, calls), "write_us": _median_us(write, calls),
            "phase_us": _median_us(phase, max(calls // 10, 1))}


def per_step(costs: dict[str, float], step_s: float, interval_s: float) -> dict[str, float]:
    steps_between = max(1, math.ceil(interval_s / step_s - 1e-9))
    us = costs["check_us"] + costs["write_us"] / steps_between
    return {"step_s": step_s, "steps_per_write": steps_between, "us_per_step": us,
            "share_of_step_pct": us / (step_s * 1e6) * 100}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, help="directory to write in (default: a temp dir)")
    p.add_argument("--step-s", type=float, nargs="+", default=[0.1, 1.0, 10.0, 60.0],
                   help="training step times to express the cost against (seconds)")
    p.add_argument("--interval-s", type=float, default=10.0, help="[loop] heartbeat_interval_s")
    p.add_argument("--calls", type=int, default=1000, help="boundaries (and writes) per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.calls < 1 or args.repeats < 1 or any(not s > 0 for s in args.step_s) or args.interval_s < 0:
        p.error("--calls and --repeats must be >= 1, --step-s values > 0, --interval-s >= 0")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        costs = measure(Path(tmp), args.calls, args.repeats)
    rows = [per_step(costs, s, args.interval_s) for s in args.step_s]
    if args.json:
        print(json.dumps({"benchmark": "heartbeat", "calls": args.calls, "repeats": args.repeats,
                          "interval_s": args.interval_s, **costs, "rows": rows}))
        return 0
    print(f"heartbeat: {costs['check_us']:.2f} us per boundary that does not write, "
          f"{costs['write_us']:.1f} us per write, {costs['phase_us']:.1f} us per phase "
          f"({args.calls} calls x {args.repeats} repeats)")
    print(f"{'step s':>7} {'steps/write':>12} {'us/step':>9} {'% of step':>10}   (interval {args.interval_s:g} s)")
    for row in rows:
        print(f"{row['step_s']:>7g} {row['steps_per_write']:>12} {row['us_per_step']:>9.2f} "
              f"{row['share_of_step_pct']:>10.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
