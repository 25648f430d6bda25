"""Devcluster benchmark: wall time of ``DevCluster.up`` (until every node is IDLE) and ``down``
(until no process of the cluster remains), and of ``reset`` on a clean cluster.

    python benchmarks/devcluster_bench.py [--nodes 3 4] [--rounds 3] [--json]

Needs root and Debian's slurm-wlm, slurmdbd, munge and mariadb-server (as the devcluster does).
Each round starts a fresh cluster in a new temp dir. Prints a markdown table (median, min, max
per node count); ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from slurmft.slurm.devcluster import DevCluster


def measure(nodes: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="dcbench-") as tmp:
        started = time.monotonic()
        cluster = DevCluster.up(os.path.join(tmp, "c"), nodes=nodes)
        up_s = time.monotonic() - started
        try:
            started = time.monotonic()
            cluster.reset()
            reset_s = time.monotonic() - started
        finally:
            started = time.monotonic()
            cluster.down()
            down_s = time.monotonic() - started
    return {"up_s": up_s, "reset_clean_s": reset_s, "down_s": down_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    results: dict[str, dict[str, list[float]]] = {}
    for nodes in args.nodes:
        runs = [measure(nodes) for _ in range(args.rounds)]
        results[str(nodes)] = {key: [r[key] for r in runs] for key in runs[0]}
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"rounds": args.rounds, "loadavg_1m": load, "results": results}))
        return 0
    print(f"devcluster timings, {args.rounds} rounds each, 1-min load average {load:.1f}\n")
    print("| nodes | step | median s | min s | max s |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for nodes, steps in results.items():
        for step, values in steps.items():
            print(f"| {nodes} | {step} | {statistics.median(values):.2f} | {min(values):.2f} "
                  f"| {max(values):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
