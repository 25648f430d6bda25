"""``gpu_check.py``'s busy part: ``slurmft.train.busy.ForwardTimer`` on a CUDA module.

20 forwards of a bf16 MLP, timed by the wall clock around them (one sync before, one after) and by
the timer's CUDA events; and the host's time to enqueue them with and without the timer's hooks
(a hook that synchronised would make the enqueue time as long as the wall time).
"""

from __future__ import annotations

import time
from typing import Any


def run() -> dict[str, Any]:
    import torch

    import _gpu_dev as dev
    from slurmft.train.busy import ForwardTimer

    width = 512 if dev.smoke() else 8192
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(dev.device(), torch.bfloat16)
    x = torch.randn(width // 2, width, device=dev.device(), dtype=torch.bfloat16)
    rows: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for timed in (False, True):
            timer = ForwardTimer(model) if timed else None
            for _ in range(3):
                model(x)
            if timer is not None:
                timer.take()
            dev.sync()
            t0 = time.perf_counter()
            for _ in range(20):
                model(x)
            enqueued = time.perf_counter() - t0
            dev.sync()
            wall = time.perf_counter() - t0
            busy = timer.take() if timer is not None else None
            if timer is not None:
                timer.remove()
            rows["with_timer" if timed else "without_timer"] = {
                "forwards": 20, "wall_s": wall, "host_enqueue_s": enqueued, "busy_s": busy}
    hooked = rows["with_timer"]
    busy = hooked["busy_s"]
    hooked["busy_over_wall"] = busy / hooked["wall_s"] if busy else None
    return rows
