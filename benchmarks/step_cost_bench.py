"""Per-step cost of the in-job helpers called every step: preemption agreement and journaled losses.

* ``preemption``: ``PreemptionHandler.should_stop()`` on real gloo ranks (``--ranks``, CPU) with
  ``check_every`` 1 (one all-reduce + ``.item()`` per step, the old default) and 10 (the default):
  median over repeats of (time of ``--steps`` calls on rank 0) / steps. On a GPU each agreement is
  also a host sync; this measures the collective alone.
* ``journal``: ``Journal.append("loss", ...)`` per step, durable (``flush_every_events=1``: one
  O_APPEND write + fsync per step, the old behaviour) and buffered (the defaults: written and
  fsynced every 100 events or 10 s, and with every durable event). Run it on the filesystem that
  will hold the run directory (``--dir``): on a shared filesystem the fsyncs dominate.

Prints a table, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _preemption_rank(rank: int, world: int, port: int, settings: tuple[int, ...], steps: int,
                     repeats: int, out: "mp.Queue[dict[int, list[float]]]") -> None:
    import torch.distributed as dist

    from slurmft.train.preemption import PreemptionHandler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        costs: dict[int, list[float]] = {}
        # Every setting on the same ranks, one after the other: a rank's start (torch's import,
        # gloo's connections) is paid once, and each setting is timed after its own warm-up.
        for check_every in settings:
            handler = PreemptionHandler(check_every=check_every)
            for _ in range(steps):  # warm-up: the first collectives set up connections
                handler.should_stop()
            costs[check_every] = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(steps):
                    handler.should_stop()
                costs[check_every].append((time.perf_counter() - t0) / steps)
        if rank == 0:
            out.put(costs)
    finally:
        dist.destroy_process_group()


def preemption_costs(settings: tuple[int, ...], ranks: int, steps: int,
                     repeats: int) -> list[dict[str, float | str]]:
    """One row per ``check_every`` in ``settings``, all measured on one start of ``ranks`` ranks."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_preemption_rank, args=(ranks, _free_port(), settings, steps, repeats, out),
                       nprocs=ranks, start_method="spawn")
    costs = out.get(timeout=60)
    return [{"what": "preemption", "setting": f"check_every={k}",
             "median_us_per_step": statistics.median(costs[k]) * 1e6,
             "max_us_per_step": max(costs[k]) * 1e6} for k in settings]


def journal_cost(directory: Path, flush_every_events: int | None, steps: int,
                 repeats: int) -> dict[str, float | str]:
    from slurmft.journal import LOSS, Journal

    costs = []
    for r in range(repeats):
        kwargs = {} if flush_every_events is None else {"flush_every_events": flush_every_events}
        journal = Journal(directory / f"run{r}-{flush_every_events}", job_id="0", restart_count=0,
                          **kwargs)
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            journal.append(LOSS, step=step, loss=1.0 / step, samples=step * 7, world_size=2)
        journal.flush()  # the buffered lines are paid for inside the measurement
        costs.append((time.perf_counter() - t0) / steps)
    setting = "durable (every event)" if flush_every_events == 1 else "buffered (defaults)"
    return {"what": "journal loss", "setting": setting,
            "median_us_per_step": statistics.median(costs) * 1e6, "max_us_per_step": max(costs) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, help="directory for the journals (default: a temp dir)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=100.0,
                   help="a training step time to express the cost against (default 100 ms)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.ranks < 2 or args.step_ms <= 0:
        p.error("--steps and --repeats must be >= 1, --ranks >= 2, --step-ms > 0")
    rows: list[dict[str, float | str]] = preemption_costs((1, 10), args.ranks, args.steps, args.repeats)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows += [journal_cost(Path(tmp), k, args.steps, args.repeats) for k in (1, None)]
    for row in rows:
        row["share_of_step_pct"] = float(row["median_us_per_step"]) / (args.step_ms * 1e3) * 100
    if args.json:
        print(json.dumps({"benchmark": "step_cost", "ranks": args.ranks, "steps": args.steps,
                          "repeats": args.repeats, "step_ms": args.step_ms, "rows": rows}))
        return 0
    print(f"per-step cost ({args.steps} steps x {args.repeats} repeats; preemption on {args.ranks} gloo ranks)")
    print(f"{'what':<14} {'setting':<24} {'median us/step':>15} {'max us/step':>12} "
          f"{f'% of {args.step_ms:g} ms step':>18}")
    for row in rows:
        print(f"{row['what']:<14} {row['setting']:<24} {row['median_us_per_step']:>15.1f} "
              f"{row['max_us_per_step']:>12.1f} {row['share_of_step_pct']:>18.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
