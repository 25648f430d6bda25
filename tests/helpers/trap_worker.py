"""One rank of a resume-check test (gloo on CPU); started by tests/unit/test_resume_check_dist.py.

A DDP loop whose batches come from the GLOBAL torch RNG, as most scripts draw them, in one of
these shapes (``--loop``):
  clean        each step draws its own batch inside the step (resumes bit for bit)
  before_loop  nanoGPT's shape: the first batch drawn after ``with Run(...)``, before the loop;
               the next one prefetched inside the step, after the forward pass
  before_run   the first batch drawn before ``with Run(...)`` (before the restore); the next one
               prefetched inside the step, after the forward pass
  lazy_prefetch  the first batch drawn lazily inside the first step (``if batch is None``); the
               next one prefetched inside the step, after the forward pass (not caught after a
               preemption: docs/limitations.md)
  eval         clean, plus an evaluation after ``optimizer.step()`` every 2 steps that draws from
               the global RNG (resumes bit for bit: the draw is in the saved RNG state)
  eval_before  an evaluation drawing from the global RNG after ``with Run(...)``, before the loop,
               at every start; batches from ``run.rng(step)`` and no dropout, so the loop never
               draws from the global RNG (resumes bit for bit: the shifted stream is never read)
  --signal-at K   rank 1 sends itself SIGUSR2 in step K (a preemption)
  --die-at K      every rank SIGKILLs itself in step K, after its report, once the save in
                  flight has committed (kill -9 of the job)
  --sleep S       each step takes S seconds longer (a run still going when the test acts on it)
  --lr LR         SGD's learning rate (0.05: the clean loop's loss is NaN by step ~20, and the
                  guard ends the run with 86; a run that must go on for long asks for less)
Each rank appends {"step", "loss"} per step to ``--out.rank<r>``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from slurmft.train import CheckpointConfig, Run, RunConfig


def draw() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 8)  # DRAW
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--loop", choices=["clean", "before_loop", "before_run", "lazy_prefetch", "eval", "eval_before"], required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--signal-at", type=int)
    p.add_argument("--die-at", type=int)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)
    dropout = torch.nn.Identity() if args.loop == "eval_before" else torch.nn.Dropout(0.1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), dropout, torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    out = open(f"{args.out}.rank{rank}", "a")
    out.write(json.dumps({"pid": os.getpid()}) + "\n")
    batch = draw() if args.loop == "before_run" else None

    with Run(model, optimizer, run_dir=args.run_dir, checkpoint=CheckpointConfig(interval=args.ckpt_every),
             config=RunConfig(log_every=1, watchdog=False)) as run:
        if args.loop == "before_loop":
            batch = draw()  # BEFORE-LOOP
        if args.loop == "eval_before":
            with torch.no_grad():
                model.module(torch.randn(16, 8))  # a held-out batch drawn from the global RNG
        for step in run.steps(args.steps):
            if args.loop in ("clean", "eval"):
                batch = draw()
            if args.loop == "eval_before":
                x = torch.randn(4, 8, generator=run.rng(step))
                batch = x, x.sum(dim=1, keepdim=True)
            if args.loop == "lazy_prefetch" and batch is None:
                batch = draw()  # LAZY-FIRST: at every start, from the restored state
            assert batch is not None
            x, y = batch
            loss = F.mse_loss(model(x), y)
            if args.loop in ("before_loop", "before_run", "lazy_prefetch"):
                batch = draw()  # PREFETCH: the next step's batch, drawn while this one trains
            loss.backward()
            time.sleep(args.sleep)
            run.report(loss=loss)
            if step == args.die_at:
                run.checkpoints.wait()  # the last periodic checkpoint committed: a known resume point
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            optimizer.zero_grad()
            if args.loop == "eval" and step % 2 == 0:
                model.eval()
                with torch.no_grad():
                    model.module(torch.randn(16, 8))  # a held-out batch drawn from the global RNG
                model.train()
            if step == args.signal_at and rank == 1:
                os.kill(os.getpid(), signal.SIGUSR2)
            out.write(json.dumps({"step": step, "loss": run.loss}) + "\n")
            out.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
