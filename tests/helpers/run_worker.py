"""One rank of a ``Run`` test (gloo on CPU); started by tests/unit/test_run_dist.py.

A plain DDP loop adopted with ``Run``: batches drawn from ``run.rng(step)``, dropout, SGD with
momentum and a step LR schedule. Each rank appends what its guard judged to ``--out.rank<r>``
(step, loss, grad norm, verdict) so the test can compare ranks.
  --signal-at K --signal-rank R   rank R sends itself SIGUSR2 in step K (a preemption seen by one rank)
  --nan-at K --nan-rank R         rank R's loss and gradients are NaN the first time step K runs
  --slow-rank R --slow-s S        rank R's forward pass takes S seconds longer (a straggler node)
  --step-sleep S                  every rank sleeps S seconds in each step (a run to interrupt)
  --find-unused                   DDP(find_unused_parameters=True): no bucket rebuild, so a restart
                                  on 3+ ranks stays bit-identical (docs/limitations.md)
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

from slurmft.train import CheckpointConfig, GuardConfig, Run, RunConfig


class Slow(torch.nn.Module):
    """Identity that takes ``seconds`` longer: a slow GPU or a noisy neighbour on one node."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--signal-at", type=int)
    p.add_argument("--signal-rank", type=int, default=1)
    p.add_argument("--nan-at", type=int, action="append", default=[])
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--guard-action", default="skip")
    p.add_argument("--max-trips", type=int, default=3)
    p.add_argument("--slow-rank", type=int)
    p.add_argument("--slow-s", type=float, default=0.0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--find-unused", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    slow = args.slow_s if rank == args.slow_rank else 0.0
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), Slow(slow), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(16, 1)), find_unused_parameters=args.find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    out = open(f"{args.out}.rank{rank}", "a")

    with Run(model, optimizer, scheduler=scheduler, run_dir=args.run_dir,
             checkpoint=CheckpointConfig(interval=args.ckpt_every),
             guards=GuardConfig(action=args.guard_action, max_trips=args.max_trips),
             config=RunConfig(heartbeat_interval_s=0, log_every=1, watchdog_timeout_s=120, seed=7)) as run:
        for step in run.steps(args.steps):
            gen = run.rng(step)
            x = torch.randn(4, 8, generator=gen)
            y = x.sum(dim=1, keepdim=True)
            loss = F.mse_loss(model(x), y)
            time.sleep(args.step_sleep)
            loss.backward()
            if step in args.nan_at and rank == args.nan_rank:  # once per step number
                args.nan_at.remove(step)
                loss = loss * float("nan")
                for param in model.parameters():
                    param.grad.mul_(float("nan"))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            if step == args.signal_at and rank == args.signal_rank:
                os.kill(os.getpid(), signal.SIGUSR2)
            ok = run.report(loss=loss, grad_norm=norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            out.write(json.dumps({"step": step, "loss": run.loss, "grad_norm": run.grad_norm,
                                  "verdict": run.result.verdict.value, "ok": ok}) + "\n")
            out.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
