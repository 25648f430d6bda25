"""The public surface of ``slurmft.train``: what ``from slurmft.train import ...`` offers, documented,
and importable without importing torch until a name is used."""

from __future__ import annotations

import inspect
import subprocess
import sys

import slurmft.train as train

PUBLIC = [
    "BoundaryCheck", "CheckpointConfig", "CheckpointError", "CheckpointManager", "GuardConfig",
    "GuardResult", "Heartbeat", "JobEnv", "LoaderWorkerInit", "PreemptionConfig", "PreemptionHandler", "ResumableSampler",
    "ResumeDivergenceWarning", "Run", "RunConfig", "SamplerError", "SaveStats", "Segment",
    "StepGuard", "StepWatchdog", "TrainState", "Verdict", "loader_worker_init", "step_generator",
]


def test_public_surface_is_pinned():
    assert train.__all__ == PUBLIC


def test_every_public_name_imports_and_is_documented():
    for name in PUBLIC:
        obj = getattr(train, name)
        doc = inspect.getdoc(obj) or ""
        assert doc and not doc.startswith(f"{name}("), f"{name} has no docstring of its own"
        if inspect.isclass(obj) and not issubclass(obj, BaseException) and name not in ("Verdict",):
            params = [p for p in inspect.signature(obj).parameters
                      if p not in ("self", "args", "kwargs") and not p.startswith("_")]
            missing = [p for p in params if p not in doc]
            assert not missing, f"{name}'s docstring does not describe {missing}"


def test_import_is_cheap_until_a_name_is_used():
    code = ("import sys, slurmft.train as t; assert 'torch' not in sys.modules, 'torch at import'; "
            "t.CheckpointConfig; assert 'torch' not in sys.modules, 'torch for a config'; "
            "from slurmft.train import Run; assert 'torch' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_unknown_name_is_an_attribute_error():
    try:
        train.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("no AttributeError")
