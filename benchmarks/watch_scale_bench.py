"""What one watcher costs at a thousand runs, and whether it ever touches a healthy one.

    python benchmarks/watch_scale_bench.py [--runs 1000] [--memory-cycles 10000]
        [--replay-days 30] [--skip-live] [--skip-replay] [--dir DIR] [--json]

1. Live (``_bench_watch_live.py``; root: it brings up its own 2-node devcluster): one watcher as
   ``slurmft watch --user $USER --all`` runs it, over ``--runs`` real run dirs on the local disk
   whose writers beat (every node of every run once per ``--beat-s``) and as many held jobs on
   the controller. Per cycle: the watcher's CPU seconds (and, apart, the squeue it runs),
   controller calls, filesystem metadata operations and bytes read per run, counted with an
   instrumented ``os`` (``_fs_ops.py``), once with the writers paused (every run idle) and once
   with them beating; then the watcher's RSS over ``--memory-cycles`` back-to-back cycles
   against the controller's last real answer, recorded (a thousand squeue calls a second would
   measure slurmctld, not the watcher).
2. Replay (``_bench_watch_replay.py``): the real decision code (``RunWatch``: detect and the
   run's state machine) driven by a simulated clock through healthy runs (steps of 0.1 s to
   60 s, saves of up to 10 minutes, evaluations, a node clock stepped by 30 s, 100 planned
   time-limit ends per run) for ``--replay-days``; every action it takes on them is listed.

Targets (issue 25): <= 2 controller calls per cycle, < 0.2 s CPU per cycle, <= 3 metadata
operations per idle run per cycle, no growth in memory; zero actions in the replay. Prints
markdown tables, or one JSON object with ``--json``. Exit 1 when a target is missed, 2 when the
devcluster or a Slurm command failed (one line).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _bench_watch_replay import replay  # noqa: E402

from slurmft.slurm.client import SlurmError  # noqa: E402
from slurmft.slurm.devcluster import DevClusterError  # noqa: E402

TARGETS = {"cycle_queries_1000_runs": 2, "cycle_cpu_s_1000_runs": 0.2, "fs_ops_per_idle_run_cycle": 3,
           "memory_growth_ratio": 1.1, "replay_actions_healthy": 0}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def summary(live: dict | None, rep: dict | None) -> dict:
    out: dict = {}
    if live is not None:
        idle, beating = live["idle"], live["beating"]
        out.update({
            "cycle_queries_1000_runs": idle["controller_calls_per_cycle"],
            "cycle_cpu_s_1000_runs": idle["cpu_s_per_cycle"],
            "fs_ops_per_idle_run_cycle": idle["fs_ops_per_run_cycle"],
            "fs_ops_per_beating_run_cycle": beating["fs_ops_per_run_cycle"],
            "bytes_read_per_idle_run_cycle": idle["bytes_read_per_run_cycle"],
            "bytes_read_per_beating_run_cycle": beating["bytes_read_per_run_cycle"],
            "memory_growth_ratio": live["memory"]["growth_ratio"],
            "live": live})
    if rep is not None:
        out.update({k: v for k, v in rep.items()})
    return out


def missed(result: dict) -> list[str]:
    wrong = []
    for key, bound in TARGETS.items():
        value = result.get(key)
        if value is None:
            continue
        if (value > bound) if key != "replay_actions_healthy" else (value != bound):
            wrong.append(f"{key} = {value} (target {'<=' if key != 'replay_actions_healthy' else '=='} {bound})")
    return wrong


def tables(result: dict) -> str:
    lines = []
    live = result.get("live")
    if live is not None:
        lines += [f"### One watcher, `--all`, {live['runs']} runs ({live['nodes_per_run']} heartbeat files "
                  f"each), {live['runs']} held jobs, Slurm {live['slurm_version']}", "",
                  "| per cycle | all runs idle | writers beating (every node every "
                  f"{live['beat_s']:g} s) |", "|---|---|---|"]
        idle, beating = live["idle"], live["beating"]
        for label, key, fmt in (("controller calls", "controller_calls_per_cycle", "{:.2f}"),
                                ("watcher CPU s", "cpu_s_per_cycle", "{:.3f}"),
                                ("squeue's own CPU s", "squeue_cpu_s_per_cycle", "{:.3f}"),
                                ("wall s", "wall_s_per_cycle", "{:.3f}"),
                                ("fs metadata ops per run", "fs_ops_per_run_cycle", "{:.2f}"),
                                ("bytes read per run", "bytes_read_per_run_cycle", "{:.0f}")):
            lines.append(f"| {label} | {fmt.format(idle[key])} | {fmt.format(beating[key])} |")
        kinds = sorted(set(idle["fs_ops_by_kind_per_run_cycle"]) | set(beating["fs_ops_by_kind_per_run_cycle"]))
        for kind in kinds:
            lines.append(f"| &nbsp;&nbsp;{kind} per run | {idle['fs_ops_by_kind_per_run_cycle'].get(kind, 0):.2f} | "
                         f"{beating['fs_ops_by_kind_per_run_cycle'].get(kind, 0):.2f} |")
        first, mem = live["first_cycle"], live["memory"]
        lines += ["", f"First cycle (adopting {first['runs_watched']} runs, saving each job's submission): "
                  f"{first['controller_calls']} controller calls, {first['cpu_s']:.1f} s CPU, "
                  f"{first['wall_s']:.1f} s; settled after {live['settle_cycles']} more cycle(s).",
                  f"Memory over {mem['cycles']} cycles ({mem['answers']}): RSS {mem['rss_kib_after_warmup']} KiB "
                  f"after {mem['samples'][0][0]} cycles, {mem['rss_kib_end']} KiB at the end "
                  f"(ratio {mem['growth_ratio']:.3f}), {mem['wall_s']:.0f} s.", ""]
    if "replay_days" in result:
        lines += [f"### Replay: {result['replay_runs']} healthy runs x {result['replay_days']:g} simulated days, "
                  f"decision code only", "",
                  "| | |", "|---|---|",
                  f"| watcher cycles per run | {result['replay_cycles']} |",
                  f"| planned time-limit ends | {result['replay_planned_ends']} |",
                  f"| planned events (planned_end, restart_action) | {result['replay_planned_events']} |",
                  f"| **actions on healthy runs** | **{result['replay_actions_healthy']}** |",
                  f"| warnings | {result['replay_warnings'] or 'none'} |",
                  f"| watcher's Slurm calls | {result['replay_client_calls'] or 'none'} |", ""]
        for action in result["replay_action_details"][:10]:
            lines.append(f"- {action}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--nodes-per-run", type=int, default=4)
    p.add_argument("--beat-s", type=float, default=60.0)
    p.add_argument("--cycles", type=int, default=5, help="measured cycles per regime")
    p.add_argument("--spacing-s", type=float, default=5.0, help="seconds between measured cycles (poll)")
    p.add_argument("--memory-cycles", type=int, default=10000)
    p.add_argument("--replay-days", type=float, default=30.0)
    p.add_argument("--replay-ends", type=int, default=100)
    p.add_argument("--replay-processes", type=int, default=2)
    p.add_argument("--skip-live", action="store_true")
    p.add_argument("--skip-replay", action="store_true")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if min(args.runs, args.nodes_per_run, args.cycles, args.memory_cycles) < 1 or args.beat_s <= 0 \
            or args.replay_days <= 0 or args.replay_ends < 0 or args.spacing_s < 0:
        p.error("sizes must be positive")
    live = rep = None
    if not args.skip_replay:
        log(f"replay: {args.replay_days:g} simulated days, {args.replay_ends} planned ends per run")
        rep = replay(days=args.replay_days, ends=args.replay_ends,
                     processes=args.replay_processes).as_json()
    if not args.skip_live:
        from _bench_watch_live import live as run_live

        work = Path(tempfile.mkdtemp(prefix="watch-scale-", dir=args.dir))
        try:
            log(f"live: {args.runs} runs and jobs on a devcluster")
            live = run_live(work, args.runs, args.nodes_per_run, args.beat_s, args.cycles,
                            args.memory_cycles, args.spacing_s)
        except (DevClusterError, SlurmError, subprocess.CalledProcessError) as exc:
            print(f"watch_scale_bench: {exc}", file=sys.stderr)
            return 2
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result = summary(live, rep)
    print(json.dumps(result, indent=2, default=str) if args.json else tables(result))
    wrong = missed(result)
    for line in wrong:
        log(f"target missed: {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
