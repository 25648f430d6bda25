"""Recovery benchmark: the same job, the same faults, with ``slurmft watch`` and with Slurm alone.

    python benchmarks/recovery_bench.py [--faults node_death hang crash] [--cap 240] [--json]

Brings up its own 4-node devcluster (root; Debian's Slurm, slurmdbd, munge, MariaDB), submits
``examples/train_gpt.py`` through ``sbatch_templates/train.sbatch`` on 2 nodes for each fault and
each mode, injects the fault once a checkpoint exists, and measures the time from the fault to
training back at the restored step (the first loss of the next segment). Slurm alone means the
template's own ``--requeue`` and nothing else; a mode that has not recovered after ``--cap``
seconds is reported as not recovered (a hung job would wait for its time limit, a crashed one
forever). Node death: also the time from the node showing DOWN to the job RUNNING again, the
watcher's own share. Last, one watcher cycle with 1,000 jobs in the queue: its CPU time and the
number of controller calls. Prints markdown tables, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slurmft.chaos.faults import rank_pids  # noqa: E402
from slurmft.journal import read_events  # noqa: E402
from slurmft.rundir import RunDir  # noqa: E402
from slurmft.slurm.cli import CliSlurmClient  # noqa: E402
from slurmft.slurm.client import JobState  # noqa: E402
from slurmft.slurm.devcluster import DevCluster, DevClusterError  # noqa: E402
from slurmft.slurm.devcluster.render import DEFAULT_SLURMD_TIMEOUT_S  # noqa: E402

TEMPLATE = REPO / "sbatch_templates" / "train.sbatch"
EXAMPLE = REPO / "examples" / "train_gpt.py"
TRAIN_ARGS = ["--tiny", "--global-batch", "12", "--heartbeat-interval", "0.5", "--ckpt-every", "5",
              "--step-sleep", "0.1", "--steps", "100000", "--watchdog-timeout", "3600"]
POLL_S = 1.0
MODES = {"watch": "slurmft watch", "slurm": "Slurm alone", "operator": "slurmft watch --operator"}
HANG_TIMEOUT_S = 10.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Trial:
    """One job with one fault, with or without a watcher."""

    def __init__(self, cluster: DevCluster, root: Path, fault: str, mode: str) -> None:
        self.cluster, self.fault, self.mode = cluster, fault, mode
        self.watched = mode != "slurm"
        self.client = CliSlurmClient(env=cluster.env)
        self.run = root / f"{fault}-{mode}"
        self.log = self.run.parent / f"{self.run.name}.out"
        env = {**os.environ, **cluster.env, "OMP_NUM_THREADS": "1", "SLURMFT_PYTHON": sys.executable,
               "SLURMFT_RUN_DIR": str(self.run)}
        self.job_id = self.client.submit(TEMPLATE, [str(EXAMPLE), *TRAIN_ARGS], env=env,
                                         sbatch_options=["--nodes=2", f"--output={self.log}",
                                                         f"--chdir={root}", "--time=30"])
        self.watcher: subprocess.Popen | None = None
        self.stopped: list[int] = []

    def events(self):
        return read_events(RunDir(self.run).events)

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.25)
        return None

    def start(self) -> None:
        ok = self.wait(lambda: any(e.kind == "checkpoint_committed" and e.get("step") >= 10
                                   for e in self.events()), 240, "checkpoint of step 10")
        if not ok:
            raise RuntimeError(f"job {self.job_id} never checkpointed step 10; see {self.log}")
        if self.watched:
            self.watcher = subprocess.Popen(
                [sys.executable, "-m", "slurmft.cli", "watch", self.job_id, "--poll", str(POLL_S),
                 "--hang-timeout", str(HANG_TIMEOUT_S),
                 *(["--operator"] if self.mode == "operator" else [])],
                env={**os.environ, **self.cluster.env}, stdout=subprocess.DEVNULL,
                stderr=open(self.run.parent / f"{self.run.name}-watch.log", "wb"),
                start_new_session=True)
            time.sleep(3 * POLL_S)  # it has seen the job running

    def inject(self) -> float:
        job = self.client.job(self.job_id)
        if self.fault == "node_death":
            self.victim = job.nodes[-1]
            self.cluster.kill_node(self.victim)
        elif self.fault == "hang":
            self.stopped = signal_rank(self.cluster, self.job_id, 1, signal.SIGSTOP)
        else:
            signal_rank(self.cluster, self.job_id, None, signal.SIGKILL)
        return time.time()

    def back_at_step(self) -> float | None:
        for event in self.events():
            if event.kind == "loss" and (event.get("restart_count") or 0) >= 1:
                return event.time
        return None

    def measure(self, cap: float) -> dict:
        self.start()
        fault_at = self.inject()
        result: dict = {"fault": self.fault, "mode": self.mode, "watched": self.watched}
        if self.fault == "node_death":
            down = self.wait(lambda: self.client.nodes([self.victim])[self.victim].down and time.time(),
                             cap, "node DOWN")
            running = self.wait(lambda: (j := self.client.job(self.job_id)).state is JobState.RUNNING
                                and j.restart_count >= 1 and time.time(), cap, "running again")
            result["down_to_running_s"] = running - down if down and running else None
        back = self.wait(self.back_at_step, cap, "training again")
        result["recovered"] = back is not None
        result["recover_s"] = back - fault_at if back else None
        detected = [e for e in self.events() if e.kind == "fault_detected"]
        result["detect_s"] = detected[0].time - fault_at if detected else None
        result["slurm_state"] = self.client.job(self.job_id).state.value
        return result

    def close(self) -> None:
        if self.watcher is not None and self.watcher.poll() is None:
            os.killpg(self.watcher.pid, signal.SIGKILL)
            self.watcher.wait(10)
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        try:
            self.client.cancel(self.job_id)
        except Exception:
            pass
        if self.fault == "node_death":
            self.cluster.start_node(self.victim)


def signal_rank(cluster: DevCluster, job_id: str, rank: int | None, sig: int) -> list[int]:
    """Send ``sig`` to the python rank processes of the job (``rank`` None: every rank)."""
    hit = []
    for pid in rank_pids(cluster.cluster_name, job_id, EXAMPLE, rank=rank):
        try:
            os.kill(pid, sig)
            hit.append(pid)
        except ProcessLookupError:
            pass
    return hit


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", nargs="+", default=["node_death", "hang", "crash"],
                        choices=["node_death", "hang", "crash"])
    parser.add_argument("--cap", type=float, default=240.0,
                        help="seconds after a fault before a mode counts as not recovered")
    parser.add_argument("--queue-jobs", type=int, default=1000)
    parser.add_argument("--no-operator", dest="operator", action="store_false",
                        help="skip the node death with `slurmft watch --operator`")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="which of watch, slurm (Slurm alone), operator to run (default: all)")
    parser.add_argument("--slurmd-timeout", type=int, default=DEFAULT_SLURMD_TIMEOUT_S,
                        help="the devcluster's SlurmdTimeout in seconds (10; real clusters: 300); "
                             "what --operator saves grows with it")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tables", type=Path, metavar="FILE",
                        help="print the tables of a saved --json output and exit")
    args = parser.parse_args()
    if args.tables is not None:
        print_tables(json.loads(args.tables.read_text()))
        return 0
    if args.cap <= 0 or args.queue_jobs < 1:
        parser.error("--cap and --queue-jobs must be positive")
    results = []
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        root = Path(tmp)
        try:
            cluster = DevCluster.up(root / "cluster", nodes=4, slurmd_timeout_s=args.slurmd_timeout)
        except DevClusterError as exc:
            parser.error(str(exc))
        try:
            for fault in args.faults:
                modes = [m for m in ("watch", "slurm", "operator") if m in args.modes
                         and (m != "operator" or (fault == "node_death" and args.operator))]
                for mode in modes:
                    cluster.reset()
                    log(f"{fault}, {MODES[mode]}")
                    trial = Trial(cluster, root, fault, mode)
                    try:
                        results.append(trial.measure(args.cap))
                    finally:
                        trial.close()
                    log(f"  -> {results[-1]}")
            cluster.reset()
            log(f"one cycle with {args.queue_jobs} jobs in the queue")
            cycle = cycle_with_many_jobs(cluster, root, args.queue_jobs)
        finally:
            cluster.down()
    by = {(r["fault"], r["mode"] != "slurm" if r["mode"] != "operator" else "operator"): r
          for r in results}
    summary = {"poll_s": POLL_S, "hang_timeout_s": HANG_TIMEOUT_S, "cap_s": args.cap,
               "slurmd_timeout_s": args.slurmd_timeout,
               "loadavg_1m": os.getloadavg()[0], "trials": results, "cycle": cycle,
               "cycle_cpu_s_1000_jobs": cycle["cpu_s"], "cycle_queries_1000_jobs": cycle["queries"]}
    if ("node_death", True) in by:
        w, s = by[("node_death", True)], by.get(("node_death", False), {})
        summary["node_death_s"] = w["recover_s"]
        summary["slurm_alone_node_death_s"] = s.get("recover_s")
        summary["node_death_ratio"] = (w["recover_s"] / s["recover_s"]
                                       if w.get("recover_s") and s.get("recover_s") else None)
        summary["node_death_down_to_running_s"] = w.get("down_to_running_s")
    if ("node_death", "operator") in by:
        op = summary["operator_node_death_s"] = by[("node_death", "operator")]["recover_s"]
        plain = summary.get("node_death_s")
        summary["operator_saves_s"] = plain - op if plain is not None and op is not None else None
    if ("hang", True) in by:
        summary["hang_recovered"] = by[("hang", True)]["recovered"]
        summary["hang_detect_s"] = by[("hang", True)]["detect_s"]
        summary["slurm_alone_hang_recovered"] = by.get(("hang", False), {}).get("recovered")
    if ("crash", True) in by:
        summary["crash_recovered"] = by[("crash", True)]["recovered"]
        summary["slurm_alone_crash_recovered"] = by.get(("crash", False), {}).get("recovered")
    if args.json:
        print(json.dumps(summary))
        return 0
    print_tables(summary)
    return 0


def print_tables(summary: dict) -> None:
    """The markdown tables of a run (also from a saved ``--json`` output: ``--tables FILE``)."""
    results, cycle = summary["trials"], summary["cycle"]

    def fmt(v) -> str:
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    print(f"recovery benchmark: poll {summary['poll_s']:g} s, hang timeout "
          f"{summary['hang_timeout_s']:g} s, SlurmdTimeout {summary.get('slurmd_timeout_s', 10):g} s, "
          f"cap {summary['cap_s']:g} s, 1-min load "
          f"{summary['loadavg_1m']:.1f}\n")
    print("| fault | mode | recovered | fault -> detected s | fault -> training again s | DOWN -> RUNNING s |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['fault']} | {MODES[r['mode']]} | "
              f"{'yes' if r['recovered'] else 'no (after cap)'} | {fmt(r['detect_s'])} | "
              f"{fmt(r['recover_s'])} | {fmt(r.get('down_to_running_s'))} |")
    print()
    print("| target | measured | met |")
    print("| --- | --- | --- |")
    if any(r["fault"] == "node_death" and r["mode"] == "slurm" for r in results):
        ratio = summary.get("node_death_ratio")
        print(f"| node death <= 0.20 x Slurm alone | {'-' if ratio is None else f'{ratio:.2f}'} "
              f"({fmt(summary.get('node_death_s'))} s "
              f"vs {fmt(summary.get('slurm_alone_node_death_s'))} s) | "
              f"{'yes' if ratio is not None and ratio <= 0.2 else 'NO'} |")
    if summary.get("operator_saves_s") is not None:
        print(f"| (no target) what --operator saves on a node death, SlurmdTimeout "
              f"{summary.get('slurmd_timeout_s', 10):g} s | {fmt(summary['operator_saves_s'])} s "
              f"({fmt(summary['operator_node_death_s'])} s vs {fmt(summary['node_death_s'])} s) | - |")
    if "hang_recovered" in summary:
        limit = summary["hang_timeout_s"] + 2 * summary["poll_s"]
        d = summary["hang_detect_s"]
        print(f"| hang detected <= timeout + 2 polls ({limit:g} s) after the stop, and recovered; "
              f"Slurm alone never | {fmt(d)} s, recovered {summary['hang_recovered']}, Slurm alone "
              f"{summary.get('slurm_alone_hang_recovered')} | "
              f"{'yes' if summary['hang_recovered'] and d is not None and d <= limit else 'NO'} |")
    if "crash_recovered" in summary:
        print(f"| crash (exit 1) recovered; Slurm alone never | {summary['crash_recovered']}, Slurm "
              f"alone {summary['slurm_alone_crash_recovered']} | "
              f"{'yes' if summary['crash_recovered'] else 'NO'} |")
    print(f"| a cycle with {cycle['jobs']} jobs queued: < 0.2 s CPU, <= 2 controller calls | "
          f"{cycle['cpu_s']:.3f} s CPU (+ {cycle['slurm_commands_cpu_s']:.3f} s in squeue/scontrol), "
          f"{cycle['queries']} calls ({', '.join(cycle['commands'])}) | "
          f"{'yes' if cycle['cpu_s'] < 0.2 and cycle['queries'] <= 2 else 'NO'} |")

if __name__ == "__main__":
    sys.exit(main())
