"""Heartbeat cost per training step: median over repeats of (time of N beat() calls) / N.

A beat is one atomic JSON replace (temp file, fsync, rename, fsync dir) every k-th step; the other
steps cost a modulo. Run it on the filesystem that will hold the run directory (``--dir``): on a
shared filesystem the fsyncs dominate. Prints a table, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from slurmft.rundir import RunDir
from slurmft.train.heartbeat import Heartbeat


def per_step_cost(directory: Path, every: int, steps: int, repeats: int) -> dict[str, float]:
    costs = []
    for r in range(repeats):
        hb = Heartbeat(RunDir(directory), f"bench{r}", job_id="0", restart_count=0, every=every)
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            hb.beat(step)
        costs.append((time.perf_counter() - t0) / steps)
    return {"every": every, "median_us_per_step": statistics.median(costs) * 1e6,
            "max_us_per_step": max(costs) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, help="directory to write in (default: a temp dir)")
    p.add_argument("--every", type=int, nargs="+", default=[1, 10, 100])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=100.0,
                   help="a training step time to express the cost against (default 100 ms)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or any(k < 1 for k in args.every):
        p.error("--steps, --repeats and --every values must be >= 1")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = [per_step_cost(Path(tmp), k, args.steps, args.repeats) for k in args.every]
    for row in rows:
        row["share_of_step_pct"] = row["median_us_per_step"] / (args.step_ms * 1e3) * 100
    if args.json:
        print(json.dumps({"benchmark": "heartbeat", "steps": args.steps, "repeats": args.repeats,
                          "step_ms": args.step_ms, "rows": rows}))
        return 0
    print(f"heartbeat cost per step ({args.steps} steps x {args.repeats} repeats)")
    print(f"{'every k':>8} {'median us/step':>15} {'max us/step':>12} {f'% of {args.step_ms:g} ms step':>18}")
    for row in rows:
        print(f"{row['every']:>8} {row['median_us_per_step']:>15.1f} {row['max_us_per_step']:>12.1f} "
              f"{row['share_of_step_pct']:>18.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
