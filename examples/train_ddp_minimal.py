"""A plain DDP training loop adopted with ``slurmft.train.Run`` (docs/adopting.md).

It is ``tests/helpers/plain_ddp_loop.py`` plus seven lines (``diff -w``): import ``Run``, open it
around the loop, draw each batch from ``run.rng(step)`` (the prefetched batch included), loop over
``run.steps``, and report the loss and gradient norm before ``optimizer.step()``. With that it
resumes from its newest valid checkpoint, saves every ``SLURMFT_CHECKPOINT_INTERVAL`` steps (500),
saves once and exits 85 on SIGUSR2/SIGTERM, writes heartbeats, skips a NaN step, and writes DONE.

    SLURMFT_RUN_DIR=/shared/runs/ddp1 sbatch -N 2 sbatch_templates/train.sbatch \
        examples/train_ddp_minimal.py --steps 2000
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from slurmft.train import Run


def get_batch(batch_size, device, generator=None):
    # A synthetic regression task: y = sin(x @ w) with a fixed w.
    x = torch.randn(batch_size, 32, device=device, generator=generator)
    w = torch.linspace(-1.0, 1.0, 32, device=device)
    return x, torch.sin(x @ w).unsqueeze(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(1234 + rank)

    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1)).to(device)
    model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    with Run(model, optimizer, scheduler=scheduler) as run:
        x, y = get_batch(args.batch_size, device, generator=run.rng(run.step + 1))
        for step in run.steps(args.steps):
            loss = F.mse_loss(model(x), y)
            x, y = get_batch(args.batch_size, device, generator=run.rng(step + 1))  # prefetch the next batch
            optimizer.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            run.report(loss=loss, grad_norm=norm)
            optimizer.step()
            scheduler.step()
            time.sleep(args.step_sleep)  # stands in for a bigger model
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
