"""Where an in-allocation recovery's time goes (issue 27): fault -> training again, by phase.

    python benchmarks/inalloc_phases_bench.py [--fault node_death|node_freeze] [--silent-s S] [--warm]
        [--json]

Brings up its own 4-node devcluster (root) and submits ``examples/train_gpt.py --tiny`` through
``sbatch_templates/train.sbatch`` in in-allocation mode with one hot spare
(``SLURMFT_SPARE_NODES=1 sbatch --nodes=4 --no-kill``), every Python process carrying the phase
tracer of ``startup_bench.py`` (``benchmarks/phase_trace/``). Once step 10 is checkpointed and
the spare's task beats, a training node other than the batch host dies (``node_death``: its
processes SIGKILLed, which on this one-host devcluster closes their sockets at once;
``node_freeze``: SIGSTOPped, sockets left open, as a dead node's on a real network). Reported,
as seconds after the fault, each mark's time on the critical path (the last process to reach it,
the first beside it): the launcher's detection and fence (journal), the torchrun agents' worker
stop, rendezvous and worker start, the new ranks' process start, ``import torch``, process group,
checkpoint load, and the first loss of the new attempt; and the ranks' own ``restart_phases``
event where the ranks journal one. Prints a table, or JSON with ``--json``. ``--warm``: the ranks are
forked from each node's warm server (``SLURMFT_WARM_WORKERS=1``, the example's imports in
``SLURMFT_WARM_IMPORTS``); the tracer's per-process start marks then belong to the server, not the
forked ranks (the ranks' own ``restart_phases`` time the fork). Without it the ranks start
cold (``SLURMFT_WARM_WORKERS=0``; warm workers are the launcher's default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _recovery_trial import freeze_node  # noqa: E402
from startup_bench import EXAMPLE, TEMPLATE, TRACER, TRAIN_ARGS, log, read_traces, wait  # noqa: E402

from slurmft import allocation  # noqa: E402
from slurmft.journal import read_events  # noqa: E402
from slurmft.rundir import RunDir  # noqa: E402
from slurmft.slurm.cli import CliSlurmClient  # noqa: E402
from slurmft.slurm.devcluster import DevCluster, DevClusterError  # noqa: E402

# examples/train_gpt.py's imports, for --warm
WARM_IMPORTS = "torch.nn,torch.nn.functional,torch.distributed.fsdp,slurmft.train"
# (label, role, tracer mark): the first time at or after the fault in each process of that role
TRACED = [
    ("agents: worker restart begins", "task", "agent_restart_workers:begin"),
    ("agents: old workers stopped", "task", "agent_stop_workers:end"),
    ("agents: rendezvous begins", "task", "agent_rendezvous:begin"),
    ("agents: rendezvous done (spare joined)", "task", "agent_rendezvous:end"),
    ("agents: new workers started", "task", "agent_start_workers:end"),
    ("new rank process started", "rank", "process_start"),
    ("new rank: interpreter ready", "rank", "interpreter_ready"),
    ("new rank: import torch done", "rank", "torch_imported"),
    ("new rank: init_process_group begins", "rank", "init_process_group:begin"),
    ("new rank: process group ready", "rank", "init_process_group:end"),
    ("new rank: checkpoint load begins", "rank", "checkpoint_load:begin"),
    ("new rank: checkpoint loaded", "rank", "checkpoint_load:end"),
]


class InallocJob:
    def __init__(self, cluster: DevCluster, root: Path, silent_s: float | None,
                 warm: bool = False) -> None:
        self.client = CliSlurmClient(env=cluster.env)
        self.cluster = cluster
        self.run = RunDir(root / "run")
        self.trace = root / "trace"
        self.trace.mkdir()
        self.log = root / "job.out"
        pythonpath = os.pathsep.join(p for p in (str(TRACER), str(HERE.parent),
                                                 os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, **cluster.env, "OMP_NUM_THREADS": "1", "SLURMFT_PYTHON": sys.executable,
               "SLURMFT_RUN_DIR": str(self.run.root), "SLURMFT_PHASE_TRACE": str(self.trace),
               "PYTHONPATH": pythonpath, "SLURMFT_SPARE_NODES": "1",
               **({"SLURMFT_NODE_SILENT_S": f"{silent_s:g}"} if silent_s is not None else {}),
               **({"SLURMFT_WARM_WORKERS": "1", "SLURMFT_WARM_IMPORTS": WARM_IMPORTS} if warm
                  else {"SLURMFT_WARM_WORKERS": "0"})}
        self.job_id = self.client.submit(TEMPLATE, [str(EXAMPLE), *TRAIN_ARGS], env=env,
                                         sbatch_options=["--nodes=4", "--no-kill", f"--output={self.log}",
                                                         f"--chdir={root}", "--time=30"])

    def events(self, kinds=None):
        return read_events(self.run.events, kinds)

    def ready(self) -> allocation.Allocation:
        wait(lambda: any((e.get("step") or 0) >= 10 for e in self.events(["checkpoint_committed"])),
             300, f"a checkpoint of step 10 (see {self.log})", poll=0.5)
        record = wait(lambda: allocation.read(self.run), 60, "allocation.json")
        wait(lambda: all(self.run.alive(n).exists() for n in record.spares), 120, "the spare's beat")
        return record

    def first_loss_after(self, t0: float):
        def seen():
            return next((e for e in self.events(["loss"])
                         if e.time and e.time > t0 and (e.get("attempt") or 0) >= 1), None)
        return wait(seen, 300, f"training again after the fault (see {self.log})", poll=0.25)


def measure(cluster: DevCluster, root: Path, fault: str, silent_s: float | None,
            warm: bool = False) -> dict:
    job = InallocJob(cluster, root, silent_s, warm)
    log(f"job {job.job_id}: 3 nodes + 1 spare")
    record = job.ready()
    batch = job.client.job(job.job_id).batch_host or record.active[0]
    victim = [n for n in record.active if n != batch][-1]
    time.sleep(1.0)
    log(f"{fault} of {victim}")
    t0 = time.time()
    if fault == "node_freeze":
        freeze_node(cluster, victim)
    else:
        cluster.kill_node(victim)
    loss = job.first_loss_after(t0)
    time.sleep(3.0)  # the last marks are written
    try:
        job.client.cancel(job.job_id)
    except Exception:  # noqa: BLE001 - cleaning up
        pass
    if fault == "node_freeze":
        cluster.kill_node(victim)
    processes = [p for p in read_traces(job.trace) if p["node"] != victim and p["role"]]
    rows = []
    journal_marks = [("launcher: fault detected (journal)", "fault_detected"),
                     ("launcher: recovery action (journal)", "recovery_action")]
    events = job.events()
    for label, kind in journal_marks:
        e = next((e for e in events if e.kind == kind and e.time and e.time >= t0), None)
        rows.append({"mark": label, "first_s": e.time - t0 if e else None,
                     "last_s": e.time - t0 if e else None, "n": int(e is not None)})
    for label, who, name in TRACED:
        times = []
        for p in processes:
            if p["role"] != who:
                continue
            after = [t for t in p["every"].get(name, []) if t is not None and t >= t0]
            if after:
                times.append(min(after))
        rows.append({"mark": label, "first_s": min(times) - t0 if times else None,
                     "last_s": max(times) - t0 if times else None, "n": len(times)})
    start = next((e for e in events if e.kind == "segment_start" and e.time and e.time >= t0), None)
    rows.append({"mark": "segment_start of the new attempt (journal)",
                 "first_s": start.time - t0 if start else None,
                 "last_s": start.time - t0 if start else None, "n": int(start is not None)})
    rows.append({"mark": "first loss of the new attempt (training again)", "first_s": loss.time - t0,
                 "last_s": loss.time - t0, "n": 1})
    rows.sort(key=lambda r: (r["last_s"] is None, r["last_s"] or 0.0))
    previous = 0.0
    for row in rows:
        row["since_previous_s"] = None if row["last_s"] is None else row["last_s"] - previous
        previous = row["last_s"] if row["last_s"] is not None else previous
    phases = next((e.fields for e in events if e.kind == "restart_phases" and e.time and e.time >= t0),
                  None)
    detected = next((e for e in events if e.kind == "fault_detected" and e.time and e.time >= t0), None)
    return {"fault": fault, "warm_workers": warm, "victim": victim, "total_s": loss.time - t0, "step": loss.get("step"),
            "restored_step": start.get("restored_step") if start else None,
            "world_size": start.get("world_size") if start else None,
            "detected_as": detected.get("cause") if detected else None,
            "node_silent_s": silent_s, "marks": rows, "restart_phases": phases}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=["node_death", "node_freeze"], default="node_death")
    parser.add_argument("--silent-s", type=float, help="SLURMFT_NODE_SILENT_S (default: the launcher's)")
    parser.add_argument("--warm", action="store_true",
                        help="SLURMFT_WARM_WORKERS=1 (the default since 2026-11-27) with the example's "
                             "imports; without it the ranks start cold (SLURMFT_WARM_WORKERS=0)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.silent_s is not None and not 1 <= args.silent_s <= 600:
        parser.error("--silent-s must be 1..600")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="inalloc-phases-") as tmp:
        root = Path(tmp)
        try:
            cluster = DevCluster.up(root / "cluster", nodes=4)
        except DevClusterError as exc:
            parser.error(str(exc))
        try:
            result = measure(cluster, root, args.fault, args.silent_s, args.warm)
        finally:
            cluster.down()
    result["loadavg_at_start"] = list(load_before)
    result["loadavg_at_end"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(result))
        return 0

    def fmt(v) -> str:
        return "-" if v is None else f"{v:.2f}"

    print(f"in-allocation recovery{' (warm workers)' if args.warm else ''}, {result['fault']} of {result['victim']} (detected as "
          f"{result['detected_as']}): fault -> training again {result['total_s']:.2f} s, back at step "
          f"{result['step']} (restored {result['restored_step']}) on {result['world_size']} ranks; "
          f"load average {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end\n")
    print("| mark | s after the fault (last process) | first process | since previous mark |")
    print("| --- | ---: | ---: | ---: |")
    for row in result["marks"]:
        print(f"| {row['mark']} | {fmt(row['last_s'])} | {fmt(row['first_s'])} | "
              f"{fmt(row['since_previous_s'])} |")
    if result["restart_phases"]:
        print("\nthe ranks' restart_phases: " + json.dumps(result["restart_phases"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
