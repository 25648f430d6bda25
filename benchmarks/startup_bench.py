"""Where a restart's start-up time goes: RUNNING -> training again, by phase, with real timestamps.

    python benchmarks/startup_bench.py [--nodes 3] [--restarts 1] [--json]

Brings up its own devcluster (root), submits ``examples/train_gpt.py --tiny`` through
``sbatch_templates/train.sbatch`` on ``--nodes`` nodes (one rank each), lets it checkpoint, then
requeues it the way ``slurmft watch`` does (``scontrol requeue``, ``StartTime=now`` once
PENDING) ``--restarts`` times. Every Python process of the job carries the phase tracer
(``benchmarks/phase_trace/sitecustomize.py``: process start from ``/proc``, ``import torch``
done, torchrun's rendezvous and worker start, ``init_process_group``, the checkpoint load, each
``srun``); the bench joins its marks with the job's journal (the launcher's first event, the
first loss) and the moment it saw the job RUNNING (polled every 0.1 s). Each mark is reported as
the time after RUNNING at which the *last* process reached it (the phases wait for each other:
the slowest node is the critical path), with the first process's time beside it. The cold start
(restart 0, nothing to load) is reported too. Prints a table per start, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slurmft.journal import read_events  # noqa: E402
from slurmft.launch import agent  # noqa: E402
from slurmft.rundir import RunDir  # noqa: E402
from slurmft.slurm.cli import CliSlurmClient  # noqa: E402
from slurmft.slurm.client import JobState  # noqa: E402
from slurmft.slurm.devcluster import DevCluster, DevClusterError  # noqa: E402

TEMPLATE = REPO / "sbatch_templates" / "train.sbatch"
EXAMPLE = REPO / "examples" / "train_gpt.py"
TRACER = REPO / "benchmarks" / "phase_trace"
TRAIN_ARGS = ["--tiny", "--global-batch", "12", "--heartbeat-interval", "0.5", "--ckpt-every", "5",
              "--step-sleep", "0.1", "--steps", "100000", "--watchdog-timeout", "3600"]

# (label, role, mark): role picks the processes (launcher, task = torchrun agent, rank), mark the
# tracer's name. In the order a start goes through them.
MARKS = [
    ("launcher process started", "launcher", "process_start"),
    ("launcher interpreter ready", "launcher", "interpreter_ready"),
    ("pre-flight srun started", "launcher", "popen#0"),
    ("pre-flight check started", "preflight", "process_start"),
    ("pre-flight sweep started", "sweep", "process_start"),
    ("pre-flight sweep done", "sweep", "process_exit"),
    ("pre-flight: import torch done", "preflight", "torch_imported"),
    ("pre-flight checks done", "preflight", "process_exit"),
    ("training srun started", "launcher", "popen#1"),
    ("torchrun process started", "task", "process_start"),
    ("torchrun: import torch done", "task", "torch_imported"),
    ("rendezvous begins", "task", "agent_rendezvous:begin"),
    ("rendezvous done", "task", "agent_rendezvous:end"),
    ("workers started", "task", "agent_start_workers:end"),
    ("rank process started", "rank", "process_start"),
    ("rank interpreter ready", "rank", "interpreter_ready"),
    ("rank: import torch done", "rank", "torch_imported"),
    ("init_process_group begins", "rank", "init_process_group:begin"),
    ("process group ready", "rank", "init_process_group:end"),
    ("checkpoint load begins", "rank", "checkpoint_load:begin"),
    ("checkpoint loaded", "rank", "checkpoint_load:end"),
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


def role(record: dict) -> str | None:
    argv = " ".join(record.get("orig_argv") or record.get("argv") or [])
    if "slurmft.launch.task" in argv or agent.MODULE in argv:
        return "task"
    if "slurmft.sweep.main" in argv or "slurmft.cli sweep" in argv:   # the pre-flight's, then before 761038f
        return "sweep"
    if "slurmft.launch.nodecheck" in argv or "slurmft.train.runtime" in argv:
        return "preflight"
    if "slurmft.launch" in argv.split():
        return "launcher"
    if str(EXAMPLE) in argv or "train_gpt.py" in argv:
        return "rank"
    return None


def read_traces(trace_dir: Path) -> list[dict]:
    """One dict per process (pid + exec): its role, restart count, torchrun attempt and marks
    (``marks``: name -> its first time; ``every``: name -> every time, for marks a process passes
    several times, such as a torchrun agent's rendezvous)."""
    processes = []
    for path in sorted(trace_dir.glob("*.jsonl")):
        current = None
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec["what"] == "process_start":  # also after an exec (same pid, new program)
                env = rec.get("env", {})
                current = {"pid": rec["pid"], "role": role(rec), "marks": {}, "every": {},
                           "popens": 0, "restart": int(env.get("SLURM_RESTART_COUNT") or 0),
                           "attempt": int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
                           "node": env.get("SLURMD_NODENAME")}
                processes.append(current)
            if current is None or rec.get("t") is None:
                continue
            name = rec["what"]
            if name == "popen":
                if (rec.get("argv") or [""])[0] != "srun":
                    continue
                name = f"popen#{current['popens']}"
                current["popens"] += 1
            current["marks"].setdefault(name, rec["t"])
            current["every"].setdefault(name, []).append(rec["t"])
    # torchrun is exec'd by slurmft.launch.task: the task's process start is torchrun's
    by_pid: dict[int, list[dict]] = {}
    for proc in processes:
        by_pid.setdefault(proc["pid"], []).append(proc)
    for chain in by_pid.values():
        if len(chain) == 2 and chain[0]["role"] == chain[1]["role"] == "task":
            chain[1]["marks"]["process_start"] = chain[0]["marks"].get("process_start")
            chain[1]["every"]["process_start"] = chain[0]["every"].get("process_start", [])
            chain[0]["role"] = None
    return processes


def phase_table(processes: list[dict], restart: int, running_at: float, first_loss: float,
                launch_event: float | None) -> dict:
    mine = [p for p in processes if p["restart"] == restart and p["role"]]
    rows = []
    for label, who, name in MARKS:
        times = [p["marks"][name] for p in mine if p["role"] == who and p["marks"].get(name)]
        if not times:
            rows.append({"mark": label, "first_s": None, "last_s": None, "n": 0})
            continue
        rows.append({"mark": label, "first_s": min(times) - running_at,
                     "last_s": max(times) - running_at, "n": len(times)})
    if launch_event is not None:
        rows.insert(2, {"mark": "launcher's first journal event", "first_s": launch_event - running_at,
                        "last_s": launch_event - running_at, "n": 1})
    rows.append({"mark": "first loss journaled (training again)", "first_s": first_loss - running_at,
                 "last_s": first_loss - running_at, "n": 1})
    previous = 0.0
    for row in rows:
        if row["last_s"] is not None:
            row["since_previous_s"] = row["last_s"] - previous
            previous = row["last_s"]
        else:
            row["since_previous_s"] = None
    return {"restart": restart, "total_s": first_loss - running_at, "marks": rows,
            "ranks": sum(p["role"] == "rank" for p in mine)}


def phases(table: dict) -> dict:
    """The marks folded into the phases the issue names (seconds on the critical path)."""
    at = {row["mark"]: row["last_s"] for row in table["marks"]}

    def span(a: str | None, b: str) -> float | None:
        start = 0.0 if a is None else at.get(a)
        end = at.get(b)
        return None if start is None or end is None else end - start

    return {
        "slurm_to_launcher_s": span(None, "launcher process started"),
        "launcher_and_preflight_s": span("launcher process started", "training srun started"),
        "preflight_s": span("pre-flight srun started", "training srun started"),
        "step_launch_s": span("training srun started", "torchrun process started"),
        "torchrun_import_s": span("torchrun process started", "rendezvous begins"),
        "rendezvous_s": span("rendezvous begins", "rendezvous done"),
        "worker_spawn_s": span("rendezvous done", "rank process started"),
        "rank_import_torch_s": span("rank process started", "rank: import torch done"),
        "process_group_s": span("rank: import torch done", "process group ready"),
        "model_build_s": span("process group ready", "checkpoint load begins"),
        "checkpoint_load_s": span("checkpoint load begins", "checkpoint loaded"),
        "first_step_s": span("checkpoint loaded", "first loss journaled (training again)"),
        "total_s": table["total_s"],
    }


class Job:
    def __init__(self, cluster: DevCluster, root: Path, nodes: int) -> None:
        self.client = CliSlurmClient(env=cluster.env)
        self.run = root / "run"
        self.trace = root / "trace"
        self.trace.mkdir()
        self.log = root / "job.out"
        pythonpath = os.pathsep.join(p for p in (str(TRACER), str(REPO), os.environ.get("PYTHONPATH"))
                                     if p)
        env = {**os.environ, **cluster.env, "OMP_NUM_THREADS": "1", "SLURMFT_PYTHON": sys.executable,
               "SLURMFT_RUN_DIR": str(self.run), "SLURMFT_PHASE_TRACE": str(self.trace),
               "PYTHONPATH": pythonpath}
        self.job_id = self.client.submit(TEMPLATE, [str(EXAMPLE), *TRAIN_ARGS], env=env,
                                         sbatch_options=[f"--nodes={nodes}", f"--output={self.log}",
                                                         f"--chdir={root}", "--time=30"])

    def events(self, kinds=None):
        return read_events(RunDir(self.run).events, kinds)

    def running(self, restart: int) -> float:
        def seen():
            job = self.client.job(self.job_id)
            return job.state is JobState.RUNNING and job.restart_count == restart and time.time()
        return wait(seen, 300, f"job {self.job_id} RUNNING with restart count {restart}")

    def first_loss(self, restart: int) -> float:
        def seen():
            for e in self.events(["loss"]):
                if (e.get("restart_count") or 0) == restart:
                    return e.time
            return None
        return wait(seen, 300, f"the first loss of restart {restart} (see {self.log})", poll=0.25)

    def launch_event(self, restart: int) -> float | None:
        for e in self.events(["template"]):
            if (e.get("restart_count") or 0) == restart:
                return e.time
        return None

    def checkpointed_after(self, restart: int, step: int) -> None:
        wait(lambda: any(e.get("restart_count") == restart and (e.get("step") or 0) >= step
                         for e in self.events(["checkpoint_committed"])), 300,
             f"a checkpoint of step >= {step} in restart {restart}", poll=0.5)

    def requeue(self, restart: int) -> None:
        self.client.requeue(self.job_id)
        wait(lambda: self.client.job(self.job_id).state is JobState.PENDING, 120, "PENDING")
        self.client.update_pending(self.job_id, start_now=True)


def measure(cluster: DevCluster, root: Path, nodes: int, restarts: int) -> list[dict]:
    job = Job(cluster, root, nodes)
    log(f"job {job.job_id} on {nodes} node(s)")
    times = [(0, job.running(0))]
    job.first_loss(0)
    for restart in range(1, restarts + 1):
        job.checkpointed_after(restart - 1, 10 if restart == 1 else 1)
        time.sleep(1.0)
        log(f"requeue {restart}")
        job.requeue(restart)
        times.append((restart, job.running(restart)))
        job.first_loss(restart)
    time.sleep(2.0)  # the last marks are written
    try:
        job.client.cancel(job.job_id)
    except Exception:  # noqa: BLE001 - cleaning up
        pass
    processes = read_traces(job.trace)
    tables = []
    for restart, running_at in times:
        table = phase_table(processes, restart, running_at, job.first_loss(restart),
                            job.launch_event(restart))
        table["phases"] = phases(table)
        table["loadavg_1m_at_end"] = os.getloadavg()[0]
        tables.append(table)
    return tables


def print_table(table: dict) -> None:
    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    kind = "cold start (nothing to load)" if table["restart"] == 0 else f"restart {table['restart']}"
    print(f"\n{kind}: RUNNING -> first loss {table['total_s']:.2f} s, {table['ranks']} rank(s)\n")
    print("| mark | s after RUNNING (last process) | first process | since previous mark |")
    print("| --- | ---: | ---: | ---: |")
    for row in table["marks"]:
        print(f"| {row['mark']} | {fmt(row['last_s'])} | {fmt(row['first_s'])} | "
              f"{fmt(row['since_previous_s'])} |")
    print("\n| phase | s |\n| --- | ---: |")
    for name, value in table["phases"].items():
        print(f"| {name} | {fmt(value)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--restarts", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.nodes <= 8 or not 1 <= args.restarts <= 20:
        parser.error("--nodes must be 1..8 and --restarts 1..20")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        root = Path(tmp)
        try:
            cluster = DevCluster.up(root / "cluster", nodes=args.nodes)
        except DevClusterError as exc:
            parser.error(str(exc))
        try:
            tables = measure(cluster, root, args.nodes, args.restarts)
        finally:
            cluster.down()
    summary = {"nodes": args.nodes, "loadavg_at_start": list(load_before),
               "loadavg_at_end": list(os.getloadavg()), "starts": tables}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"start-up phases: {args.nodes} node(s) x 1 rank, load average at start "
          f"{load_before[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    for table in tables:
        print_table(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
