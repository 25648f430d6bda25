"""Per-step overhead of ``slurmft.train.Run`` against the same loop without it.

    python benchmarks/run_overhead_bench.py [--world 2] [--steps 300] [--rounds 5] [--json]

Starts ``--world`` ranks (gloo on CPU, 127.0.0.1) that train one small DDP model. Each round runs
the bare loop and then every ``Run`` variant for ``--steps`` steps, interleaved so that machine
noise hits all of them alike. A step's time is the interval between the starts of consecutive
steps (the first step and the final save are left out; checkpoint saves are not in these steps:
their cost is ``benchmarks/ckpt_bench.py``'s). Reported per variant: the median step time of the
slowest rank, and the overhead over the bare loop in microseconds and as a share of a 100 ms step
(the target: under 1 %). The median shows the cost every step pays; the mean adds what only some
steps pay (a heartbeat write every 10th step, a journal event every ``log_every``-th).

Variants: ``Run`` with its defaults (one all-reduce per step in ``report``; a ``loss`` journal
event, one append + fsync on rank 0, every 10 steps; a heartbeat every 10 steps; the watchdog),
with ``log_every=1`` (a journal event every step, as the examples do), and ``log_every=1`` resumed
from a checkpoint whose later steps the journal holds (the resume check's worst case: every step
of the measured run is compared with the interrupted run's fingerprint, RNG digest included).

The resume check's own cost is also timed inside rank 0 (where it runs): the fingerprint hooks
(``ResumeAudit.step_started``/``step_done`` and the input digest's forward pre-hook), wall and
CPU time per step. Those are what the check adds to a step, and unlike the step intervals they are
not drowned by a loaded machine's scheduling noise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_STEP_S = 0.100
VARIANTS = ("bare", "run (defaults)", "run (log_every=1)", "run (resumed)")


class HookTimer:
    """Wall and CPU seconds spent in the resume check's per-step hooks (rank 0)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def wrap(self, owner: type, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.thread_time() - cpu
        setattr(owner, name, timed)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from slurmft.train import CheckpointConfig, Run, RunConfig
    from slurmft.train.fingerprint import InputDigest
    from slurmft.train.resume_audit import ResumeAudit

    hooks = HookTimer()  # before any Run: the pre-hook is registered as the patched method
    for owner, name in ((ResumeAudit, "step_started"), (ResumeAudit, "step_done"),
                        (ResumeAudit, "loop_started"), (ResumeAudit, "trace_window"), (InputDigest, "_before")):
        hooks.wrap(owner, name)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 64), torch.randn(16, 1)

    def body(run=None) -> None:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if run is not None:
            run.report(loss=loss)
        optimizer.step()
        optimizer.zero_grad()

    def step_times(starts: list[float]) -> list[float]:
        return [b - a for a, b in zip(starts[1:], starts[2:])]  # drop the first step

    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    hook_s: dict[str, list[float]] = {v: [0.0, 0.0, 0] for v in VARIANTS}  # wall, cpu, steps
    steps = args.steps
    for round_ in range(args.rounds):
        starts = []
        for _ in range(steps):
            starts.append(time.perf_counter())
            body()
        dist.barrier()
        starts.append(time.perf_counter())
        results["bare"] += step_times(starts)
        for variant, log_every in (("run (defaults)", None), ("run (log_every=1)", 1), ("run (resumed)", 1)):
            run_dir = Path(args.dir) / f"r{round_}-{variant.split()[-1].strip('()=')}"
            interval, first, total = 10 * steps, 0, steps
            if variant == "run (resumed)":  # checkpoint `steps`, then steps+1 .. 2*steps-1 journaled
                with Run(model, optimizer, run_dir=run_dir, checkpoint=CheckpointConfig(interval=steps),
                         config=RunConfig.load(log_every=1)) as run:
                    for step in run.steps(2 * steps):
                        body(run)
                        if step == 2 * steps - 1:
                            break  # "killed": no final save
                interval, first, total = 10 * steps, steps, 2 * steps
            starts = []
            wall, cpu = hooks.wall, hooks.cpu
            with Run(model, optimizer, run_dir=run_dir, checkpoint=CheckpointConfig(interval=interval),
                     config=RunConfig.load(log_every=log_every)) as run:
                assert (run.restored_step or 0) == first, (variant, run.restored_step)
                for _step in run.steps(total):
                    starts.append(time.perf_counter())
                    body(run)
                starts.append(time.perf_counter())  # after the last boundary and the final save
            results[variant] += step_times(starts[:-1])
            hook_s[variant][0] += hooks.wall - wall
            hook_s[variant][1] += hooks.cpu - cpu
            hook_s[variant][2] += total - first
    stats = {v: (statistics.median(t), statistics.fmean(t),
                 hook_s[v][0] / max(hook_s[v][2], 1), hook_s[v][1] / max(hook_s[v][2], 1))
             for v, t in results.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", help="run directories go here (default: a temporary dir)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.world < 1 or args.steps < 3 or args.rounds < 1:
        p.error("--world >= 1, --steps >= 3 and --rounds >= 1")
    with tempfile.TemporaryDirectory(prefix="run-bench-", dir=args.dir) as tmp:
        out = Path(tmp) / "result.json"
        port = free_port()
        procs = []
        for rank in range(args.world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.world),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(args.world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            env.pop("SLURMFT_RUN_DIR", None)
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", "--dir", tmp, "--out", str(out),
                 "--steps", str(args.steps), "--rounds", str(args.rounds)], env=env))
        deadline = time.monotonic() + 60 + 0.05 * args.steps * args.rounds * (len(VARIANTS) + 2)
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                print("run_overhead_bench: ranks did not finish in time", file=sys.stderr)
                return 1
        if any(proc.returncode for proc in procs) or not out.exists():
            print(f"run_overhead_bench: a rank failed: {[p.returncode for p in procs]}", file=sys.stderr)
            return 1
        per_rank = json.loads(out.read_text())
    median = {v: max(r[v][0] for r in per_rank) for v in VARIANTS}  # the slowest rank
    mean = {v: max(r[v][1] for r in per_rank) for v in VARIANTS}
    rows = [{"variant": v, "median_step_us": median[v] * 1e6, "mean_step_us": mean[v] * 1e6,
             "median_overhead_us": (median[v] - median["bare"]) * 1e6,
             "mean_overhead_us": (mean[v] - mean["bare"]) * 1e6,
             "mean_share_of_100ms_step_pct": (mean[v] - mean["bare"]) / TARGET_STEP_S * 100,
             "resume_check_wall_us": per_rank[0][v][2] * 1e6, "resume_check_cpu_us": per_rank[0][v][3] * 1e6}
            for v in VARIANTS]
    report = {"world": args.world, "steps": args.steps, "rounds": args.rounds,
              "target_pct": 1.0, "rows": rows,
              "met": rows[1]["mean_share_of_100ms_step_pct"] < 1.0}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"Run overhead: {args.world} rank(s) (gloo, CPU), {args.rounds} rounds x {args.steps} steps, "
          f"slowest rank")
    print(f"| {'variant':<18} | median step us | mean step us | median overhead us | mean overhead us "
          f"| mean overhead / 100 ms step | resume check us/step (rank 0, wall / CPU) |")
    print(f"| {'-' * 18} | -------------- | ------------ | ------------------ | ---------------- "
          f"| --------------------------- | ----------------------------------------- |")
    for r in rows:
        print(f"| {r['variant']:<18} | {r['median_step_us']:14.0f} | {r['mean_step_us']:12.0f} | "
              f"{r['median_overhead_us']:18.0f} | {r['mean_overhead_us']:16.0f} | "
              f"{r['mean_share_of_100ms_step_pct']:26.3f}% | "
              f"{r['resume_check_wall_us']:19.1f} / {r['resume_check_cpu_us']:19.1f} |")
    print(f"target (defaults): mean overhead < 1 % of a 100 ms step: {'met' if report['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
