"""How long one `slurmft sweep` takes on this node: full vs --quick, median of N runs.

In-process rows run the real sweep (every built-in check, real fact sources of this machine:
NVML, /dev/kmsg, dcgmi, statvfs, mounts, /sys/class/infiniband, /proc/meminfo; state, report and
Prometheus textfile written to a temp dir) against a static in-memory node list, so they time
slurmft's own work. With ``--slurm-conf`` (a live cluster, e.g. a devcluster) the process rows run
the sweep with ``--dry-run`` as a process, Python start-up and controller queries included, through
both ways in: ``slurmft sweep`` (the CLI: cron, HealthCheckProgram) and ``python -m
slurmft.sweep.main`` (the pre-flight's, on every node of every job start), each with its CPU
time. Budgets (wall): full < 2 s, quick < 1 s (exit 1 when a median is over). Prints a table;
``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurmft.config import ConfigError
from slurmft.health.registry import HealthConfig, plan
from slurmft.slurm.client import Node, NodeState
from slurmft.sweep.config import SweepConfig
from slurmft.sweep.run import SweepRequest, sweep

BUDGET_S = {"normal": 2.0, "quick": 1.0}


class StaticNodes:
    """Four idle nodes; records nothing, changes nothing (a healthy node needs no action)."""

    def nodes(self, names=None):
        return {f"n{i}": Node(f"n{i}", NodeState.IDLE) for i in range(1, 5)}

    def drain(self, node, reason):  # pragma: no cover - a healthy bench node is never drained
        raise RuntimeError(f"benchmark node would be drained: {reason}")

    def resume(self, node):  # pragma: no cover
        raise RuntimeError("benchmark node would be resumed")


def time_in_process(mode: str, runs: int, work: Path, checks: tuple[str, ...] = ()) -> list[float]:
    cfg = SweepConfig(checks=checks, state_dir=work / "state", report_dir=work / "reports",
                      textfile_dir=work / "prom")
    hc = HealthConfig()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        report = sweep(SweepRequest("n1", mode), cfg, hc, StaticNodes())
        out.append(time.perf_counter() - t0)
        if not report.healthy:
            raise SystemExit(f"this node is not healthy, cannot benchmark: {report.to_json()['results']}")
    return out


# The two ways in to the same sweep: the CLI and the pre-flight's module.
DOORS = {"cli": ["{bin}/slurmft", "sweep"], "module": ["{python}", "-m", "slurmft.sweep.main"]}


def time_process(door: str, mode: str, runs: int, slurm_conf: Path, node: str, work: Path,
                 checks: tuple[str, ...] = ()) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds (user + system: the sweep's process and the commands it waited for,
    sinfo and the checks' tools) of each of ``runs`` sweeps."""
    config = work / "slurmft.toml"
    config.write_text(f'[sweep]\nstate_dir = "{work}/cli-state"\nreport_dir = "{work}/cli-reports"\n'
                      f'textfile_dir = "{work}/cli-prom"\n' + (f"checks = {json.dumps(list(checks))}\n" if checks else ""))
    head = [a.format(bin=Path(sys.executable).parent, python=sys.executable) for a in DOORS[door]]
    argv = [*head, "--dry-run", "--node", node, "--config", str(config)]
    argv += ["--quick"] if mode == "quick" else []
    env = {**os.environ, "SLURM_CONF": str(slurm_conf)}
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        if res.returncode != 0:
            raise SystemExit(f"{' '.join(head)} exited {res.returncode}: {res.stderr.strip()}")
    return walls, cpus


def row(name: str, mode: str, samples: list[float], cpu: list[float] | None = None) -> dict:
    med = statistics.median(samples)
    return {"run": name, "mode": mode, "runs": len(samples), "median_s": round(med, 4),
            "min_s": round(min(samples), 4), "max_s": round(max(samples), 4),
            "cpu_median_s": round(statistics.median(cpu), 4) if cpu else None,
            "budget_s": BUDGET_S[mode], "within_budget": med < BUDGET_S[mode]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--slurm-conf", type=Path, help="also time the sweep's processes against this live cluster")
    p.add_argument("--node", default="n1", help="node name for the process rows (default n1)")
    p.add_argument("--checks", default="", help="comma-separated checks to run (default: every built-in one)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    checks = tuple(c for c in args.checks.split(",") if c)
    try:
        plan(checks, HealthConfig(), "normal")
    except ConfigError as exc:
        p.error(f"--checks: {exc}")
    if args.runs < 1:
        p.error("--runs must be >= 1")
    if args.slurm_conf is not None and not args.slurm_conf.is_file():
        p.error(f"--slurm-conf {args.slurm_conf} does not exist")
    rows = []
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
        work = Path(tmp)
        for mode in ("normal", "quick"):
            rows.append(row("in-process", mode, time_in_process(mode, args.runs, work, checks)))
        if args.slurm_conf is not None:
            for door in DOORS:
                for mode in ("normal", "quick"):
                    walls, cpus = time_process(door, mode, args.runs, args.slurm_conf, args.node, work, checks)
                    rows.append(row(f"{door}+slurm", mode, walls, cpus))
    ok = all(r["within_budget"] for r in rows)
    if args.json:
        print(json.dumps({"benchmark": "sweep", "rows": rows, "ok": ok}))
    else:
        print(f"{'run':<12} {'mode':<7} {'runs':>4} {'median s':>9} {'min s':>7} {'max s':>7} {'CPU s':>7} "
              f"{'budget':>7}  ok")
        for r in rows:
            cpu = "-" if r["cpu_median_s"] is None else f"{r['cpu_median_s']:.4f}"
            print(f"{r['run']:<12} {r['mode']:<7} {r['runs']:>4} {r['median_s']:>9.4f} {r['min_s']:>7.4f} "
                  f"{r['max_s']:>7.4f} {cpu:>7} {r['budget_s']:>6.1f}s  {'yes' if r['within_budget'] else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
