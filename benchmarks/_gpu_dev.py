"""Where ``gpu_check.py``'s torch parts run: GPU 0 (NCCL), or, with ``--cpu-smoke``, the CPU (gloo):
a dry run of the script's own code on a machine without a GPU, whose numbers mean nothing."""

from __future__ import annotations

import os

SMOKE_ENV = "GPU_CHECK_CPU_SMOKE"


def smoke() -> bool:
    return os.environ.get(SMOKE_ENV) == "1"


def device() -> str:
    return "cpu" if smoke() else "cuda"


def backend() -> str:
    return "gloo" if smoke() else "nccl"


def sync() -> None:
    if not smoke():
        import torch

        torch.cuda.synchronize()
