"""ckpt_bench's incremental phase: bytes written and save time of slurmft's incremental saves
against whole saves of the same state, after a real training step before every save.

Two states: the benchmark's pre-training state (every parameter and Adam tensor changes every
step: nothing to reuse, so this measures what hashing costs), and a fine-tuning state of the same
size whose bytes are about ``FROZEN_SHARE`` frozen base (FSDP2 layers with ``requires_grad`` off,
so no optimizer state) and the rest a trained head with Adam. Bytes are summed over the ranks,
times are the slowest rank's, medians over the measured saves. The measured series make no
periodic whole save; the report also gives the average over a ``full_every`` cycle (the default).
"""

from __future__ import annotations

import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from _bench_limits import max_across_ranks, sum_across_ranks
from _bench_state import N_LAYERS
from slurmft.checkpoint.manager import CheckpointConfig, CheckpointManager
from slurmft.checkpoint.state import TrainState

FROZEN_SHARE = 0.9
WARMUP_SAVES = 1  # the first save of a manager is whole either way


def build_fine_tuning_state(state_bytes: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """N_LAYERS frozen square layers (fp32, no optimizer state) and a trained head with Adam
    (param + two moments) holding the other ``1 - FROZEN_SHARE`` of ``state_bytes``."""
    torch.manual_seed(1)
    width = max(64, math.ceil(math.sqrt(state_bytes * FROZEN_SHARE / (4 * N_LAYERS)) / 64) * 64)
    head = max(8, round(state_bytes * (1 - FROZEN_SHARE) / (12 * width)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(N_LAYERS)],
                          nn.Linear(width, head, bias=False))
    for layer in model[:N_LAYERS]:
        layer.requires_grad_(False)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model[N_LAYERS].parameters(), lr=1e-4)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    width = next(model.parameters()).shape[1]
    model(torch.randn(4, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _series(model: nn.Module, optimizer: torch.optim.Optimizer, run_dir: Path, saves: int,
            incremental: bool) -> dict[str, Any]:
    config = CheckpointConfig(keep_last=2, incremental=incremental, full_every=saves + WARMUP_SAVES + 1)
    manager = CheckpointManager(run_dir, config)
    state = TrainState(model, optimizer)
    written, totals = [], []
    try:
        for step in range(1, WARMUP_SAVES + saves + 1):
            _train_step(model, optimizer)
            manager.save(step, state, block=True)
            stats = manager.stats[-1]
            if step > WARMUP_SAVES:
                written.append(sum_across_ranks(stats.bytes_written))
                totals.append(max_across_ranks(stats.total_s))
    finally:
        manager.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"bytes_written": statistics.median(written), "total_s": statistics.median(totals)}


def measure_incremental(pretraining: tuple[nn.Module, torch.optim.Optimizer], state_bytes: int,
                        base: Path, saves: int) -> dict[str, Any]:
    """Whole and incremental series for the pre-training state and a fine-tuning one."""
    out: dict[str, Any] = {"frozen_share": FROZEN_SHARE, "full_every": CheckpointConfig().full_every}
    fine_tuning = build_fine_tuning_state(state_bytes)
    for name, (model, optimizer) in (("pre-training", pretraining), ("fine-tuning", fine_tuning)):
        out[name] = {kind: _series(model, optimizer, base / f"incremental-{name}-{kind}", saves,
                                   kind == "incremental")
                     for kind in ("whole", "incremental")}
    return out
