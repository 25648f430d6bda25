"""Benchmark state and measuring instruments: the FSDP2 model + Adam every method saves, and memory.

The state is built once per rank and shared by every method of one benchmark run, so all methods
save exactly the same bytes. Memory is measured as PSS of the rank's whole process tree (the rank
plus any checkpoint daemon it spawned), so shared-memory staging buffers are neither missed nor
counted twice.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

N_LAYERS = 8
# Adam keeps exp_avg and exp_avg_sq: state bytes = 3 x parameter bytes (fp32).
STATE_PER_PARAM_BYTES = 3 * 4


def layer_width(state_bytes: int) -> int:
    """Width of the N_LAYERS square Linear layers whose params + Adam state reach ``state_bytes``."""
    params = state_bytes / STATE_PER_PARAM_BYTES
    width = math.ceil(math.sqrt(params / N_LAYERS) / 64) * 64
    return max(width, 64)


def build_state(state_bytes: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An FSDP2-sharded MLP with an Adam optimizer that has taken one step (so its state exists)."""
    torch.manual_seed(0)
    width = layer_width(state_bytes)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(N_LAYERS)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss = model(torch.randn(4, width)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of every parameter and every optimizer-state tensor (the saved bytes)."""
    tensors = [_local(p.detach()) for p in model.parameters()]
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                tensors.append(_local(value))
    return tensors


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def touch_parameters(model: nn.Module) -> None:
    """Change every parameter in place, as the next optimizer step would."""
    with torch.no_grad():
        for p in model.parameters():
            _local(p).mul_(1.0001)


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _descendants(pid: int) -> list[int]:
    found = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            found.append(int(child))
            found.extend(_descendants(int(child)))
    return found


def tree_pss_bytes(pid: int | None = None) -> int:
    """Proportional set size of a process and all its descendants (0 for vanished ones)."""
    root = os.getpid() if pid is None else pid
    total = 0
    for p in [root, *_descendants(root)]:
        try:
            with open(f"/proc/{p}/smaps_rollup", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


class MemorySampler:
    """Samples the process tree's PSS in a thread; ``extra`` is the peak above the starting value."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline = 0
        self.peak = 0

    def __enter__(self) -> "MemorySampler":
        self.baseline = self.peak = tree_pss_bytes()
        self._thread = threading.Thread(target=self._run, name="bench-mem", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, tree_pss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.peak = max(self.peak, tree_pss_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds``."""

    def __enter__(self) -> "Stopwatch":
        self._t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
