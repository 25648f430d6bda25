"""slurmft.train: the in-job side, the training loop (``Run`` and its helpers); with
``slurmft.checkpoint`` (the checkpoint engine it uses) the only packages that import torch.

The public API is importable from here (``from slurmft.train import Run, CheckpointManager``);
each name is imported on first use, so ``import slurmft.train`` itself stays cheap and torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it (one place; tests/unit/test_train_api.py pins the surface)
_EXPORTS: dict[str, str] = {
    "Run": "slurmft.train.run",
    "RunConfig": "slurmft.train.run_config",
    "CheckpointManager": "slurmft.checkpoint.manager",
    "CheckpointError": "slurmft.checkpoint.outcomes",
    "SaveStats": "slurmft.checkpoint.outcomes",
    "CheckpointConfig": "slurmft.checkpoint.config",
    "TrainState": "slurmft.checkpoint.state",
    "ResumableSampler": "slurmft.train.sampler",
    "SamplerError": "slurmft.train.sampler",
    "PreemptionHandler": "slurmft.train.preemption",
    "PreemptionConfig": "slurmft.train.preemption",
    "LoaderWorkerInit": "slurmft.train.loader_workers",
    "loader_worker_init": "slurmft.train.loader_workers",
    "Heartbeat": "slurmft.train.heartbeat",
    "StepGuard": "slurmft.train.guards",
    "GuardConfig": "slurmft.train.guards",
    "GuardResult": "slurmft.train.guards",
    "Verdict": "slurmft.train.guards",
    "StepWatchdog": "slurmft.train.watchdog",
    "JobEnv": "slurmft.train.runtime",
    "Segment": "slurmft.train.runtime",
    "BoundaryCheck": "slurmft.train.boundary",
    "ResumeDivergenceWarning": "slurmft.train.boundary",
    "step_generator": "slurmft.train.boundary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slurmft.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
