"""A plain DDP training loop as public examples write it — BEFORE adopting slurmft.

Written here for the adoption tests (not copied from anywhere): batches are drawn from the global
RNG and the next batch is prefetched while the current step runs. ``examples/train_ddp_minimal.py``
is this file after the README's "Adopting slurmft" change; tests/unit/test_adoption_diff.py counts
the lines that change. Run it with ``torchrun --nproc-per-node=2 plain_ddp_loop.py``.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


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

    x, y = get_batch(args.batch_size, device)
    for step in range(args.steps):
        loss = F.mse_loss(model(x), y)
        x, y = get_batch(args.batch_size, device)  # prefetch the next batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        time.sleep(args.step_sleep)  # stands in for a bigger model
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
