"""Where a verified checkpoint load (``CheckpointManager.load_latest``) spends its time, by phase.

One process per action, so each load starts as a restarted rank does (fresh memory, no warm caches
but the page cache's), and two slurmft source trees can be compared on the same checkpoint::

    python benchmarks/load_bench.py TREE save DIR     # a model + AdamW of $SIZE GiB (default 3) on $DEV
    python benchmarks/load_bench.py TREE load DIR     # load it; COLD=1 drops its pages from the cache first
    python benchmarks/load_bench.py TREE micro DIR    # the floors: reads, a first touch, host-to-device copies

TREE is a directory holding a slurmft source tree (e.g. ``git archive <rev> slurmft | tar -x -C
TREE``); ``DEV=cpu`` (8192-wide layers on cuda, 2048 on the CPU). The load's
phases are timed by wrapping the reader's methods: reading + hashing into host buffers,
delivering (unpickling each tensor and copying it into the state), the rest of ``read_data``
(allocating the buffers), and ``TrainState.load_state_dict``; plus CPU time, minor page faults,
the share of the shard files in the page cache before the load, and a digest of the loaded state
(equal across trees: the same bytes loaded). It prints a table of the result, or with ``--json``
one JSON object. Results: docs/performance.md, "Loading".
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

DEV = "cuda"   # $DEV and $SIZE, checked by main()
SIZE = 3.0


def _sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def _model(seed: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(seed)
    width = 8192 if DEV == "cuda" else 2048
    n = max(1, round(SIZE * (1 << 30) / 3 / (width * width * 4)))  # params + 2 Adam moments
    layers = [torch.nn.Linear(width, width, bias=False, device=DEV) for _ in range(n)]
    layers.append(torch.nn.Linear(width, width, bias=False, device=DEV).to(torch.bfloat16))
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, width, device=DEV)
    for layer in model:
        x = layer(x.to(layer.weight.dtype))
    x.float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync()
    return model, optimizer


def _tensors(model: Any, optimizer: Any) -> list[Any]:
    import torch

    out = list(model.state_dict().values())
    for state in optimizer.state_dict()["state"].values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return out


def _digest(model: Any, optimizer: Any) -> str:
    sums = [float(t.double().sum().item()) for t in _tensors(model, optimizer)]
    return hashlib.sha1(repr(sums).encode()).hexdigest()[:12]


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident(path: str) -> float:
    """The share of ``path``'s pages in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    addr = libc.mmap(None, ctypes.c_size_t(size), 1, 1, fd, ctypes.c_long(0))  # PROT_READ, MAP_SHARED
    os.close(fd)
    pages = (size + 4095) // 4096
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
    libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    return sum(v & 1 for v in vec) / pages


def _shards(where: str) -> list[str]:
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(where) for f in fs if f.endswith(".distcp"))


def _save(where: str) -> dict[str, Any]:
    from slurmft.checkpoint.manager import CheckpointConfig, CheckpointManager
    from slurmft.checkpoint.state import TrainState

    model, optimizer = _model(0)
    manager = CheckpointManager(where, CheckpointConfig(keep_last=1))
    t0 = time.perf_counter()
    manager.save(3, TrainState(model, optimizer))
    manager.wait()
    out = {"state_bytes": sum(t.nbytes for t in _tensors(model, optimizer)), "save_s": time.perf_counter() - t0}
    manager.close()
    return {**out, "digest": _digest(model, optimizer)}


def _load(where: str) -> dict[str, Any]:
    from slurmft.checkpoint import verified_read
    from slurmft.checkpoint.manager import CheckpointManager
    from slurmft.checkpoint.state import TrainState

    model, optimizer = _model(1)
    phases: dict[str, float] = {}

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    reader = verified_read.VerifyingReader
    verified_read._deliver = timed("deliver (unpickle + copy into state)", verified_read._deliver)
    reader._read_from = timed("read + hash (into host buffers)", reader._read_from)
    reader.read_data = timed("reader.read_data total", reader.read_data)
    TrainState.load_state_dict = timed("TrainState.load_state_dict", TrainState.load_state_dict)
    files = _shards(where)
    if os.environ.get("COLD") == "1":
        for f in files:
            _drop(f)
    out: dict[str, Any] = {"resident_before": {os.path.basename(f): round(_resident(f), 3) for f in files}}
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    manager = CheckpointManager(where)
    t0 = time.perf_counter()
    out["step"] = manager.load_latest(TrainState(model, optimizer))
    _sync()
    out["load_s"] = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    manager.close()
    out.update(phases_s=phases, cpu_user_s=r1.ru_utime - r0.ru_utime, cpu_sys_s=r1.ru_stime - r0.ru_stime,
               minflt=r1.ru_minflt - r0.ru_minflt, maxrss_gb=r1.ru_maxrss / 1e6, digest=_digest(model, optimizer))
    return out


def _micro(where: str) -> dict[str, Any]:
    import torch
    import xxhash

    path = _shards(where)[0]
    size = os.path.getsize(path)
    buf = memoryview(bytearray(1 << 20))
    out: dict[str, Any] = {}
    for label in ("read_hash_reused_1MiB_GBps", "cold_read_hash_GBps"):
        if label.startswith("cold"):
            _drop(path)
        hasher, t = xxhash.xxh3_128(), time.perf_counter()
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                hasher.update(buf[:n])
        out[label] = size / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    host = torch.empty(size, dtype=torch.uint8)
    host.fill_(1)
    out["fresh_touch_GBps"] = size / (time.perf_counter() - t) / 1e9
    if DEV == "cuda":
        gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
        _sync()
        for k in range(2):
            t = time.perf_counter()
            gpu.copy_(host)
            _sync()
            out[f"h2d_pageable_GBps_{k}"] = size / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        out["pin_alloc_s"] = time.perf_counter() - t
        pinned.copy_(host)
        t = time.perf_counter()
        gpu.copy_(pinned, non_blocking=True)
        _sync()
        out["h2d_pinned_GBps"] = size / (time.perf_counter() - t) / 1e9
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    global DEV, SIZE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tree", type=Path, help="a directory holding a slurmft source tree (TREE/slurmft)")
    p.add_argument("action", choices=("save", "load", "micro"))
    p.add_argument("dir", type=Path, help="the run directory the checkpoint is saved to / loaded from")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if not (args.tree / "slurmft" / "__init__.py").is_file():
        p.error(f"TREE {args.tree}: no slurmft package in it")
    DEV = os.environ.get("DEV", "cuda")
    if DEV not in ("cuda", "cpu"):
        p.error(f"DEV={DEV!r}: must be cuda or cpu")
    try:
        SIZE = float(os.environ.get("SIZE", "3"))
    except ValueError:
        SIZE = math.nan
    if not (math.isfinite(SIZE) and SIZE > 0):
        p.error(f"SIZE={os.environ.get('SIZE')!r}: must be a number of GiB > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    sys.path.insert(0, str(args.tree))
    import torch

    result = {"tree": str(args.tree), "action": args.action, "torch": torch.__version__,
              **{"save": _save, "load": _load, "micro": _micro}[args.action](str(args.dir))}
    if args.json:
        print(json.dumps(result), flush=True)
        return
    print("| what | value |\n| --- | --- |")
    for key, value in result.items():
        print(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")


if __name__ == "__main__":
    main()
