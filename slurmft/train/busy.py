"""Per-node busy time for the heartbeat: how long this rank's model forward pass takes.

In synchronous training every rank's wall time per step is the same (the slowest rank sets it),
so the step time cannot tell which node is slow. A rank's own forward compute can: under DDP (and
plain data parallelism) the forward pass has no collective, so a node with a slow GPU, a
throttled CPU or a noisy neighbour shows a longer forward than its peers while every step takes
as long everywhere. The watcher compares these per-node times (its straggler rule).

``ForwardTimer`` hooks the model's forward (a pre-hook and a post-hook on the module the loop
calls) and sums the time of every forward since the last ``take()``. On CUDA it records events on
the current stream (device time, no host sync in the step); ``take()`` waits for the last one,
which the heartbeat asks for only every k steps, after the step's own sync. On CPU it reads the
host clock.

Limits: only the node leader (local rank 0) is timed, so a slow GPU behind another local rank
shows only as far as it slows rank 0's collectives (not at all in the forward, under DDP); under
FSDP (or tensor/pipeline parallelism) the forward itself runs collectives
(all-gathers), so a slow peer's delay shows up in every rank's forward and the straggler rule
sees less; a module called more than once per step (gradient accumulation) is summed; a module
compiled with its hooks (``module.compile()``) is not timed (the hooks return at once when
traced): pass ``Run`` the ``torch.compile`` wrapper, whose hooks run outside the compiled code.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class ForwardTimer:
    """Sum of this rank's forward-pass time between ``take()`` calls.

    module: the model as the loop calls it (DDP's wrapper included: its forward adds no collective
    unless it broadcasts buffers). Remove the hooks with ``remove()``.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._cpu_total = 0.0
        self._cpu_started: float | None = None
        self._events: list[tuple[Any, Any]] = []
        self._pending: Any = None
        self._calls = 0
        self._handles = [module.register_forward_pre_hook(self._before),
                         module.register_forward_hook(self._after)]

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # hooks inside a compiled region: not timed, not traced
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized() and _on_cuda(module):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending = start
        else:
            self._cpu_started = time.perf_counter()

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._pending is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._pending, end))
            self._pending = None
        elif self._cpu_started is not None:
            self._cpu_total += time.perf_counter() - self._cpu_started
            self._cpu_started = None
        else:
            return
        self._calls += 1

    def take(self) -> float | None:
        """Seconds of forward time since the last call (None: no forward ran); resets the sum."""
        if not self._calls:
            return None
        total = self._cpu_total
        if self._events:
            self._events[-1][1].synchronize()
            total += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
        self._cpu_total, self._events, self._calls = 0.0, [], 0
        return total

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _on_cuda(module: torch.nn.Module) -> bool:
    param = next(module.parameters(), None)
    return param is not None and param.is_cuda
