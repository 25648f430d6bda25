"""A small GPT trained with FSDP2 that survives preemption, time limits, NaNs and hangs.

Byte-level language model (vocabulary 256) on the Shakespeare text in ``examples/data/``: token
and position embeddings, pre-norm transformer blocks with causal self-attention, an LM head tied
to the token embedding; every block and the root are sharded with ``fully_shard``. It runs on
CPU/gloo as it is and on GPUs/NCCL unchanged (device and backend follow ``torch.cuda``).

The loop runs inside ``slurmft.train.Run``, which wires every in-job piece: async checkpoints and
resume from the newest valid one (any world size), preemption (USR2/TERM -> one emergency save ->
exit REQUEUE), heartbeats, the guard (NaN / spike -> skip or roll back; repeated -> exit
NO_REQUEUE), the step watchdog (hung step -> stacks + exit HANG) and the journal, where rank 0
writes every step's loss with a digest of the step's samples so runs can be compared.
``ResumableSampler`` gives the same global batch and sample order on any world size.

Launch with torchrun (see ``sbatch_templates/train.sbatch``) or plainly as one process.
The ``--inject-*`` and ``--step-sleep`` flags exist for the fault tests.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import signal
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from slurmft import exitcodes
from slurmft.rundir import RunDir
from slurmft.train import (CheckpointConfig, GuardConfig, JobEnv, ResumableSampler, Run, RunConfig,
                           SamplerError, Segment)

DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    seq_len: int = 128
    d_model: int = 256
    n_heads: int = 8
    n_layers: int = 6


# For tests, the demo and the soak: one block (still two FSDP2 units, it and the root), less CPU
# per step than two. Two heads: with four, step 78's gradient norm tripped the guard (no trip
# with two in 3,000 steps on 3 ranks nor in 400 on 1, 2 and 4; docs/performance.md, 2026-11-29).
TINY = ModelConfig(seq_len=32, d_model=32, n_heads=2, n_layers=1)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ByteWindows:
    """Non-overlapping windows of ``seq_len + 1`` bytes: sample i -> (input, next-byte target)."""

    def __init__(self, paths: list[Path], seq_len: int) -> None:
        text = b"".join(p.read_bytes() for p in paths)
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def batch(self, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([self.data[i * self.seq_len:i * self.seq_len + self.seq_len + 1]
                            for i in indices])
        return rows[:, :-1].to(device), rows[:, 1:].to(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default=os.environ.get("SLURMFT_RUN_DIR"),
                   help="run directory (default: $SLURMFT_RUN_DIR)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--tiny", action="store_true", help="a very small model, for tests")
    p.add_argument("--d-model", type=int, help="override the model width")
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--micro-batch", type=int, help="per-rank micro-batch (default: no accumulation)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--heartbeat-interval", type=float, default=10.0,
                   help="seconds between heartbeat writes, at step boundaries (default 10)")
    p.add_argument("--watchdog-timeout", type=float, help="seconds; default: adaptive")
    p.add_argument("--guard-action", choices=("skip", "rollback"), default="rollback")
    p.add_argument("--guard-max-trips", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (tests)")
    p.add_argument("--inject-nan-at", type=int, help="make the loss NaN at this step")
    p.add_argument("--inject-nan-times", type=int, default=1,
                   help="how many times the injected step may produce NaN in this process")
    p.add_argument("--inject-hang-at", type=int, help="one rank sleeps forever in this step")
    p.add_argument("--inject-hang-rank", type=int, default=0)
    p.add_argument("--inject-hang-attempt", type=int,
                   help="hang only in this torchrun attempt (the world's, in-allocation mode; else "
                        "TORCHELASTIC_RESTART_COUNT); default: every one")
    p.add_argument("--inject-hang-how", choices=("sleep", "stop"), default="sleep",
                   help="sleep: in Python (its own watchdog fires); stop: SIGSTOP itself, frozen "
                        "whole as a process stuck in the kernel or holding the GIL (nothing of it runs)")
    args = p.parse_args(argv)
    if not args.run_dir:
        p.error("no run directory: pass --run-dir or set $SLURMFT_RUN_DIR")
    for name in ("steps", "ckpt_every", "global_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.heartbeat_interval <= 3600:
        p.error("--heartbeat-interval must be between 0 and 3600 seconds")
    return args


def init_distributed(env: JobEnv) -> torch.device:
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{env.local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=env.pg_timeout_s))
    else:  # one process started by hand
        store = dist.HashStore()
        dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=0, world_size=1)
    return device


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = JobEnv.from_environ()
    device = init_distributed(env)

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    cfg = TINY if args.tiny else ModelConfig()
    if args.d_model:
        cfg = ModelConfig(**{**cfg.__dict__, "d_model": args.d_model})
    data = ByteWindows(sorted(DATA_DIR.glob("*.md")), cfg.seq_len)
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    # foreach: one DTensor dispatch per operation over all parameters (torch's default on a GPU);
    # on the CPU its default is one per parameter, most of a small model's optimizer step.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=True)
    try:
        sampler = ResumableSampler(len(data), args.global_batch, rank=env.rank,
                                   world_size=env.world_size, micro_batch_size=args.micro_batch,
                                   seed=args.seed)
    except SamplerError as exc:
        Segment(env, RunDir(Path(args.run_dir))).end(
            exitcodes.NO_REQUEUE, f"bad batch geometry: {exc}", barrier=dist.barrier)
    nan_budget = args.inject_nan_times

    with Run(model, optimizer, sampler=sampler, run_dir=args.run_dir, env=env,
             checkpoint=CheckpointConfig.load(interval=args.ckpt_every),
             guards=GuardConfig(action=args.guard_action, max_trips=args.guard_max_trips),
             config=RunConfig.load(heartbeat_interval_s=args.heartbeat_interval, seed=args.seed, log_every=1,
                                   watchdog_timeout_s=args.watchdog_timeout),
             info={"global_batch": args.global_batch,
                   "accumulation": sampler.plan.accumulation_steps}) as run:
        for step in run.steps(args.steps):
            micro_batches = sampler.next_step()
            total = torch.zeros((), device=device)
            for indices in micro_batches:
                x, y = data.batch(indices, device)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(micro_batches)
                loss.backward()
                total += loss.detach()
            if step == args.inject_nan_at and nan_budget > 0:
                nan_budget -= 1
                total = total * float("nan")
                for p in model.parameters():
                    p.grad.mul_(float("nan"))
            # the world's agreed attempt (in-allocation mode): a node whose agent only followed a
            # restart keeps torchrun's count of its own, 0
            attempt = run.segment.journal.attempt
            if step == args.inject_hang_at and env.rank == args.inject_hang_rank and \
                    args.inject_hang_attempt in (None, env.attempt if attempt is None else attempt):
                if args.inject_hang_how == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                while True:
                    time.sleep(3600)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if run.report(loss=total, grad_norm=norm,
                          samples=zlib.crc32(repr(sampler.global_batch(step - 1)).encode())):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # The interpreter's last collections walk torch's whole object graph on the way out:
        # ~0.7 CPU-s per rank measured here (2.5 -> 1.8 CPU-s for a process that only imports
        # torch and slurmft.train), paid by every rank of every start. Everything this script
        # writes is closed by now (Run's exit, the process group), so keep them off that graph.
        gc.freeze()
