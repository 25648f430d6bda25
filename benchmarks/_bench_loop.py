"""A save's cost where users feel it: inside a real FSDP2 training loop.

Each measured save pairs two windows of ``WINDOW_STEPS`` training steps (forward, backward, Adam
step) on the same state: one without a save and one that starts with the save call, in turn first
(so a machine that speeds up or slows down does not favour either). The save's in-loop overhead is
the difference. The next save starts only after this one is durable, outside both windows; how long
that last wait took says whether the window covered the whole save (``after_window_s``). A copy
probe right before each pair gives the bare copy of the same bytes at that moment, so the overhead
can be said as a fraction of it. A method with ``committed_after_s`` must have committed every save.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _bench_limits import max_across_ranks

WINDOW_STEPS = 4
WARMUP_SAVES = 1
BATCH_ROWS = 16


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _window(model, optimizer, batch, save=None) -> float:
    """Seconds of WINDOW_STEPS steps (the slowest rank), the first preceded by ``save()`` if given."""
    dist.barrier()
    t0 = time.perf_counter()
    if save is not None:
        save()
    for _ in range(WINDOW_STEPS):
        _train_step(model, optimizer, batch)
    return max_across_ranks(time.perf_counter() - t0)


def measure_in_loop(method, model, optimizer, probe, base: Path | None, saves: int) -> dict[str, Any]:
    """Per measured save: the window without and with a save, the overhead, the copy probe."""
    width = model[0].weight.shape[1]
    torch.manual_seed(1234 + dist.get_rank())
    batch = torch.randn(BATCH_ROWS, width)
    _train_step(model, optimizer, batch)  # warm the loop itself before anything is timed
    measured = []
    for i in range(WARMUP_SAVES + saves):
        path = base / f"loop-{i}" if base is not None else None
        copy_s = probe.copy()
        if i % 2:
            plain_s = _window(model, optimizer, batch)
        with_save_s = _window(model, optimizer, batch, save=lambda: method.start(i + 1, path))
        t0 = time.perf_counter()
        method.finish()
        after_window_s = max_across_ranks(time.perf_counter() - t0)
        method.committed_after_s()  # raises for a slurmft save that did not commit
        if not i % 2:
            plain_s = _window(model, optimizer, batch)
        if i >= WARMUP_SAVES:
            measured.append({"plain_s": plain_s, "with_save_s": with_save_s, "after_window_s": after_window_s,
                             "overhead_s": with_save_s - plain_s, "copy_s": copy_s})
        dist.barrier()
        if path is not None and dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
    method.close()
    return {"saves": measured, "window_steps": WINDOW_STEPS}
