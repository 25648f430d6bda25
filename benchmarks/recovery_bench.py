"""Recovery benchmark: one job and fault, recovered in the allocation, by requeue, by Slurm alone.

The same job and the same faults, recovered in the allocation (a spare, or shrinking), by requeue
with ``slurmft watch``, and by Slurm alone, at one or more SlurmdTimeouts in one run.

    python benchmarks/recovery_bench.py [--slurmd-timeout 10 120] [--faults node_death hang crash]
        [--modes watch slurm operator inalloc shrink] [--cap S] [--json]

For each ``--slurmd-timeout`` it brings up its own 4-node devcluster (root; Debian's Slurm,
slurmdbd, munge, MariaDB), submits ``examples/train_gpt.py`` through ``sbatch_templates/train.sbatch``
on 3 training nodes for each fault and mode (``_recovery_trial.py``: the in-allocation modes with
``sbatch --no-kill``, one spare or shrinking to 2), injects the fault once step 10 is checkpointed
(node death: a non-batch training node's slurmd and processes SIGKILLed; node freeze: the same
processes SIGSTOPped, so that their sockets stay open as a dead node's do on a real network,
while the kernel closes a killed one's on this one-host devcluster; hang: rank 1's training
process SIGSTOPped (in the allocation the ranks' watchdog at 10 s, as the soak's, ends the world);
crash: rank 1 SIGKILLed), and measures the time from the fault to training again (the first loss of
the first segment started after the fault), where it came back (step and restored step, world
size), the job states seen on the way and, in the allocation, the ranks' ``restart_phases``. Slurm
alone means the template's own ``--requeue`` and nothing else; a mode that has not recovered after
the cap (default 240 s + 2 x (SlurmdTimeout - 10)) is reported as not recovered. Node death by
requeue: also the time from the node showing DOWN to the job RUNNING again, the watcher's own
share. Last, one watcher cycle with ``--queue-jobs`` jobs in the queue (0: skipped). Prints
markdown tables, or one JSON object with ``--json``: issue 27's keys (``requeue_node_death_s``,
``slurm_alone_node_death_s``, ``inalloc_node_death_s``, ``inalloc_shrink_s``, ``inalloc_crash_s``,
``restart_phases``) each map a SlurmdTimeout ("10", "120") to its figure; ``runs`` holds each
timeout's trials.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _recovery_report import issue_keys, merge, print_tables, timeout_summary  # noqa: E402
from _recovery_trial import (FAULTS, HANG_TIMEOUT_S, MODES, NODE_FAULTS, NODES, POLL_S,  # noqa: E402
                             Trial, log)

from slurmft.rundir import RunDir  # noqa: E402
from slurmft.slurm.cli import CliSlurmClient  # noqa: E402
from slurmft.slurm.devcluster import DevCluster, DevClusterError  # noqa: E402

CLUSTER_NODES = NODES + 1  # room for the spare
# A frozen node's last job may stay COMPLETING on it until Slurm gave up on it (SlurmdTimeout)
RESET_S = 300.0
MODE_FAULTS = {"watch": FAULTS, "slurm": FAULTS, "operator": NODE_FAULTS,
               "inalloc": ("node_death", "node_freeze", "hang", "crash"), "shrink": NODE_FAULTS,
               "spent": NODE_FAULTS, "spare2": ("node_death",)}


def cycle_with_many_jobs(cluster: DevCluster, root: Path, jobs: int) -> dict:
    """One watcher cycle over one watched run while ``jobs`` held jobs sit in the queue."""
    from slurmft.watch.config import WatchConfig
    from slurmft.watch.loop import Watcher
    from slurmft.watch.runwatch import RunWatch
    from slurmft.watch.state import RunState

    client = CliSlurmClient(env=cluster.env)
    script = root / "held.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    ids = [client.submit(script, sbatch_options=["--hold", f"--output={root}/held.out"])
           for _ in range(jobs)]
    run = RunDir(root / "cycle-run")
    run.root.mkdir(parents=True, exist_ok=True)
    calls = []
    real_run = client._run
    client._run = lambda argv, **kw: (calls.append(argv[0]), real_run(argv, **kw))[1]
    client.info()
    watcher = Watcher(client, [RunWatch(run, RunState(job_id=ids[0]), client, WatchConfig())],
                      poll_s=POLL_S)
    watcher.cycle()  # warm
    calls.clear()
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = watcher.cycle()
    wall = time.monotonic() - started
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)

    def cpu(a, b) -> float:
        return (b.ru_utime - a.ru_utime) + (b.ru_stime - a.ru_stime)

    subprocess.run(["scancel", *ids], env={**os.environ, **cluster.env}, timeout=120,
                   capture_output=True)
    return {"jobs": jobs, "observed": result.observed, "queries": len(calls), "commands": calls,
            "cpu_s": cpu(self_before, self_after), "slurm_commands_cpu_s": cpu(children_before,
                                                                                children_after),
            "wall_s": wall}


def run_names(timeouts: list[int]) -> list[str]:
    """Each run's name in the work dir (its cluster's and its trials' run dirs): the timeout, and
    for a timeout given again its occurrence, so that ``--slurmd-timeout 10 10 10`` repeats the
    trials instead of reusing the first run's dirs (``10``, ``10-2``, ``10-3``)."""
    seen: dict[int, int] = {}
    names = []
    for t in timeouts:
        seen[t] = seen.get(t, 0) + 1
        names.append(str(t) if seen[t] == 1 else f"{t}-{seen[t]}")
    return names


def run_timeout(slurmd_timeout: int, args, root: Path, name: str | None = None) -> dict:
    """Every fault x mode on one devcluster with this SlurmdTimeout (``name``: see run_names)."""
    name = name or str(slurmd_timeout)
    cap = args.cap if args.cap is not None else 240.0 + 2 * (slurmd_timeout - 10)
    load_start = os.getloadavg()[0]
    results = []
    try:
        # spare2: two nodes dead, and room for the requeued 3 + 1 elsewhere
        nodes = CLUSTER_NODES + (2 if "spare2" in args.modes else 0)
        cluster = DevCluster.up(root / f"cluster-{name}", nodes=nodes,
                                slurmd_timeout_s=slurmd_timeout)
    except DevClusterError as exc:
        raise SystemExit(f"recovery_bench: the devcluster did not start: {exc}") from None
    cycle = None
    try:
        for fault in args.faults:
            for mode in [m for m in MODES if m in args.modes and fault in MODE_FAULTS[m]]:
                try:
                    cluster.reset(timeout=RESET_S)
                except DevClusterError as exc:  # a node still completing the last job: next trial
                    log(f"SlurmdTimeout {slurmd_timeout}: {fault}, {MODES[mode]}: skipped: {exc}")
                    results.append({"fault": fault, "mode": mode, "watched": mode != "slurm",
                                    "recovered": False, "recover_s": None, "detect_s": None,
                                    "error": f"not run: {exc}"})
                    continue
                log(f"SlurmdTimeout {slurmd_timeout}: {fault}, {MODES[mode]}")
                trial = Trial(cluster, root, fault, mode, tag=f"-{name}")
                try:
                    results.append(trial.measure(cap))
                except RuntimeError as exc:  # this trial could not be run: say so, go on
                    results.append({"fault": fault, "mode": mode, "watched": mode != "slurm",
                                    "recovered": False, "recover_s": None, "detect_s": None,
                                    "error": str(exc)})
                finally:
                    trial.close()
                log(f"  -> {results[-1]}")
        if args.queue_jobs and args.with_cycle:
            cluster.reset()
            log(f"one watcher cycle with {args.queue_jobs} jobs in the queue")
            cycle = cycle_with_many_jobs(cluster, root, args.queue_jobs)
    finally:
        cluster.down()
    summary = timeout_summary(results, slurmd_timeout, cap)
    summary["loadavg_1m_start"] = load_start
    summary["loadavg_1m_end"] = os.getloadavg()[0]
    summary["cycle"] = cycle
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slurmd-timeout", type=int, nargs="+", default=[10, 120],
                        help="the devclusters' SlurmdTimeout in seconds, one run each (default: 10 "
                             "120; real clusters: 300); a value given again repeats its run")
    parser.add_argument("--faults", nargs="+", default=["node_death", "hang", "crash"], choices=FAULTS,
                        help="default: node_death hang crash (node_freeze: a node's processes "
                             "SIGSTOPped, its sockets left open, as on a real network)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="which recoveries to run (default: all): " +
                             ", ".join(f"{k} = {v}" for k, v in MODES.items()))
    parser.add_argument("--cap", type=float,
                        help="seconds after a fault before a mode counts as not recovered "
                             "(default 240 + 2 x (SlurmdTimeout - 10))")
    parser.add_argument("--queue-jobs", type=int, default=1000,
                        help="jobs in the queue for the watcher-cycle measurement (0: skip it)")
    parser.add_argument("--dir", type=Path, help="work dir, kept afterwards (job logs, run dirs, "
                        "watcher logs); default: a temp dir, removed")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tables", type=Path, metavar="FILE",
                        help="print the tables of a saved --json output and exit")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="FILE",
                        help="join saved --json outputs (e.g. modes run at different times) into "
                             "one, printed as tables or, with --json, as JSON; and exit")
    args = parser.parse_args()
    if args.tables is not None:
        print_tables(json.loads(args.tables.read_text()))
        return 0
    if args.merge:
        merged = merge([json.loads(path.read_text()) for path in args.merge])
        print(json.dumps(merged) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            print_tables(merged)
        return 0
    if args.cap is not None and args.cap <= 0:
        parser.error("--cap must be positive")
    if args.queue_jobs < 0:
        parser.error("--queue-jobs must be >= 0")
    if any(not 5 <= t <= 3600 for t in args.slurmd_timeout):
        parser.error("--slurmd-timeout values must be 5..3600 seconds")
    runs = []
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        work = Path(tmp) if args.dir is None else args.dir.absolute()
        work.mkdir(parents=True, exist_ok=True)
        for i, (slurmd_timeout, name) in enumerate(zip(args.slurmd_timeout,
                                                       run_names(args.slurmd_timeout))):
            args.with_cycle = i == 0  # the watcher's cycle does not depend on the timeout
            runs.append(run_timeout(slurmd_timeout, args, work, name))
    cycle = runs[0].pop("cycle", None)
    for run in runs[1:]:
        run.pop("cycle", None)
    summary = {"poll_s": POLL_S, "hang_timeout_s": HANG_TIMEOUT_S, "nodes": NODES,
               "slurmd_timeouts": args.slurmd_timeout, "loadavg_1m": os.getloadavg()[0],
               "runs": runs, "cycle": cycle, **issue_keys(runs)}
    if cycle:
        summary["cycle_cpu_s_1000_jobs"] = cycle["cpu_s"]
        summary["cycle_queries_1000_jobs"] = cycle["queries"]
    if args.json:
        print(json.dumps(summary))
        return 0
    print_tables(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
