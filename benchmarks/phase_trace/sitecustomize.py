"""Start-up phase tracer for ``benchmarks/startup_bench.py`` (a benchmark tool, never product code).

Python imports ``sitecustomize`` at start-up from the first directory of ``sys.path`` that has
one; the bench puts this directory first on the job's ``PYTHONPATH`` and names a trace directory in
``$SLURMFT_PHASE_TRACE``. Every Python process of the job (the launcher, the pre-flight, each
node's torchrun agent, each rank) then appends one JSON line per phase mark to
``<trace dir>/<node>.<pid>.jsonl``: the process's start (from ``/proc/self/stat``, so the time
before the interpreter ran counts), the interpreter ready (this module), ``import torch`` done,
torchrun's rendezvous and worker start, the ranks' ``init_process_group`` and checkpoint load,
and every ``subprocess.Popen`` (the launcher's ``srun`` steps). Wall-clock times (``time.time()``),
comparable across the devcluster's nodes (one host). Without ``$SLURMFT_PHASE_TRACE`` it does
nothing. A mark that cannot be written is dropped: the tracer must never change the job.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
import time

_DIR = os.environ.get("SLURMFT_PHASE_TRACE")
_ENV_KEYS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_STEP_ID", "SLURMD_NODENAME", "RANK",
             "TORCHELASTIC_RESTART_COUNT")


def _process_start() -> float | None:
    """The wall time this process was forked/exec'd (before the interpreter started). The boot
    time comes from ``/proc/uptime`` (10 ms), not ``/proc/stat``'s ``btime`` (whole seconds: up to
    1 s early)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime) counted from field 3 after the ')'
        with open("/proc/uptime") as f:
            booted = time.time() - float(f.read().split()[0])
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def mark(what: str, t: float | None = None, **fields) -> None:
    if not _DIR:
        return
    record = {"what": what, "t": time.time() if t is None else t, "pid": os.getpid(), **fields}
    try:
        path = os.path.join(_DIR, f"{os.environ.get('SLURMD_NODENAME', 'none')}.{os.getpid()}.jsonl")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def _timed(owner, name: str, label: str) -> None:
    """Mark the begin and end of ``owner.name`` (a function or method) each time it runs."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        mark(f"{label}:begin")
        try:
            return original(*args, **kwargs)
        finally:
            mark(f"{label}:end")

    setattr(owner, name, wrapper)


def _after_torch(module) -> None:
    mark("torch_imported")


def _after_dist(module) -> None:
    _timed(module, "init_process_group", "init_process_group")


def _after_api(module) -> None:
    _timed(module.SimpleElasticAgent, "_rendezvous", "agent_rendezvous")
    _timed(module.SimpleElasticAgent, "_restart_workers", "agent_restart_workers")


def _after_local_agent(module) -> None:
    _timed(module.LocalElasticAgent, "_start_workers", "agent_start_workers")
    _timed(module.LocalElasticAgent, "_stop_workers", "agent_stop_workers")


def _after_loading(module) -> None:
    _timed(module.CheckpointLoading, "load_latest", "checkpoint_load")


_AFTER = {
    "torch": _after_torch,
    "torch.distributed.distributed_c10d": _after_dist,
    "torch.distributed.elastic.agent.server.api": _after_api,
    "torch.distributed.elastic.agent.server.local_elastic_agent": _after_local_agent,
    "slurmft.checkpoint.loading": _after_loading,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook once a watched module has executed (the real finder and loader do the work)."""

    def find_spec(self, fullname, path, target=None):
        hook = _AFTER.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            try:
                hook(module)
            except Exception as exc:  # noqa: BLE001 - a tracer must never break the job
                mark("hook_failed", module=fullname, error=repr(exc))

        loader.exec_module = exec_module
        return spec


def _popen_marks() -> None:
    import subprocess

    original = subprocess.Popen.__init__

    @functools.wraps(original)
    def init(self, args, *rest, **kwargs):
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
        mark("popen", argv=argv[:6])
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = init


if _DIR:
    mark("process_start", t=_process_start(), argv=sys.argv[:4] if hasattr(sys, "argv") else [],
         orig_argv=list(getattr(sys, "orig_argv", []))[:8],
         env={k: os.environ[k] for k in _ENV_KEYS if k in os.environ})
    mark("interpreter_ready")
    import atexit

    atexit.register(mark, "process_exit")
    sys.meta_path.insert(0, _AfterImport())
    _popen_marks()
