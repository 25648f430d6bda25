"""``gpu_check.py``'s checkpoint part: saving a model that lives in GPU memory (one process, GPU 0).

A model of ``--size-gb`` GiB of parameters + AdamW state on the GPU (fp32 layers and one bf16
layer), saved to ``--dir`` with the methods of ``ckpt_bench.py`` (``_bench_slurmft.SlurmftSave``,
``_bench_methods.DcpAsyncSave``): per save, how long the training loop is blocked (staging: the
device-to-host copy) against the whole save (committed / durable). Methods:

* slurmft, ``overlap = false``: ``save()`` copies everything before it returns (pinned buffers).
* slurmft, ``overlap = true`` in a loop: ``save()`` returns at once, the copy runs on a side stream
  beside the next forward/backward, ``optimizer.step()`` fences it; the stall is blocking + fence.
* ``dcp.async_save`` with DCP's defaults, and with a reused ``DefaultStager`` using pinned memory,
  non-blocking copies and asynchronous staging (what the CPU benchmark could not try).
Also a bare device-to-host copy of the same bytes into pinned buffers (the floor), and the
restore: a fresh model and optimizer loaded from slurmft's last checkpoint compared bit for bit
on the GPU with the state that was saved.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import _gpu_dev as dev

SAVES = 2  # measured, after one warm-up each


def _model(size_gb: float):
    import torch

    width = 8192
    layer_bytes = width * width * 4
    n_fp32 = max(1, round(size_gb * (1 << 30) / 3 / layer_bytes))  # params + 2 Adam moments
    layers = [torch.nn.Linear(width, width, bias=False) for _ in range(n_fp32)]
    layers.append(torch.nn.Linear(width, width, bias=False).to(torch.bfloat16))
    model = torch.nn.Sequential(*layers).to(dev.device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def _step(model, optimizer, seed: int) -> None:
    import torch

    g = torch.Generator(device=dev.device()).manual_seed(seed)
    x = torch.randn(64, model[0].in_features, device=dev.device(), generator=g)
    out = x
    for layer in model:
        out = layer(out.to(layer.weight.dtype))
    out.float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tensors(model, optimizer) -> list:
    import torch

    out = list(model.state_dict().values())
    for state in optimizer.state_dict()["state"].values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _d2h_floor(tensors: list) -> dict[str, float]:
    """Copy every tensor into preallocated pinned host buffers (non-blocking, one sync)."""
    import torch

    src = [t for t in tensors if t.device.type == dev.device()]
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=not dev.smoke()) for t in src]
    times = []
    for _ in range(3):
        dev.sync()
        t0 = time.perf_counter()
        for b, t in zip(bufs, src):
            b.copy_(t, non_blocking=True)
        dev.sync()
        times.append(time.perf_counter() - t0)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    del bufs
    return {"bytes": nbytes, "copy_s": min(times), "gb_per_s": nbytes / min(times) / 1e9}


def _series(method, model, optimizer, base: Path, in_loop: bool) -> list[dict[str, Any]]:
    """One warm-up + SAVES saves; blocking = start() (plus the next step's fence in a loop)."""

    out = []
    for i in range(1 + SAVES):
        _step(model, optimizer, seed=100 + i)
        dev.sync()
        t0 = time.perf_counter()
        path = base / f"{method.name[:8].replace(' ', '_')}-{i}"
        method.start(i + 1, path)
        blocked = time.perf_counter() - t0
        loop_s = None
        if in_loop:  # the next training step runs while the copy is in flight
            t1 = time.perf_counter()
            _step(model, optimizer, seed=200 + i)
            dev.sync()
            loop_s = time.perf_counter() - t1
        method.finish()
        done = time.perf_counter() - t0
        committed = method.committed_after_s()
        row = {"blocking_s": blocked, "total_s": committed if committed is not None else done,
               "next_step_s": loop_s}
        stats = getattr(method, "_manager", None)
        if stats is not None:
            last = stats.stats[-1]
            row.update(stall_s=last.stall_s, fenced_s=last.fenced_s, copied_s=last.copied_s,
                       bytes=last.bytes_written)
        if i >= 1:
            out.append(row)
        shutil.rmtree(path, ignore_errors=True)  # DCP's checkpoints (slurmft's keep_last prunes its own)
    return out


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in rows[0] if all(isinstance(r.get(k), (int, float)) for r in rows)]
    return {"saves": rows, **{f"median_{k}": statistics.median(r[k] for r in rows) for k in keys}}


def _restore_check(run_dir: Path, model, optimizer, size_gb: float) -> dict[str, Any]:
    """A fresh model (other seed) + optimizer restored from run_dir's newest checkpoint equals
    the live model and optimizer (saved with no step since) bit for bit, on the GPU."""
    import torch

    from slurmft.checkpoint.manager import CheckpointManager
    from slurmft.checkpoint.state import TrainState

    torch.manual_seed(999)
    fresh, fresh_opt = _model(size_gb)
    _step(fresh, fresh_opt, seed=7)   # optimizer state exists (as in a resumed job)
    manager = CheckpointManager(run_dir)
    t0 = time.perf_counter()
    step = manager.load_latest(TrainState(fresh, fresh_opt))
    load_s = time.perf_counter() - t0
    manager.close()
    want, have = _tensors(model, optimizer), _tensors(fresh, fresh_opt)
    bad = [i for i, (a, b) in enumerate(zip(want, have))
           if a.dtype != b.dtype or a.device != b.device or not torch.equal(a, b)]
    dtypes = sorted({str(t.dtype) for t in have})
    result = {"restored_step": step, "load_s": load_s, "tensors": len(have), "dtypes": dtypes,
              "devices": sorted({str(t.device) for t in have}),
              "mismatched": bad if len(want) == len(have) else f"{len(want)} vs {len(have)} tensors",
              "bit_equal": not bad and len(want) == len(have)}
    del fresh, fresh_opt
    if not dev.smoke():
        torch.cuda.empty_cache()
    return result


def _close(method, result: dict[str, Any]) -> None:
    """``method.close()``; a failure there (a staging future that failed re-raises) is recorded."""
    try:
        method.close()
    except Exception as exc:  # noqa: BLE001
        result.setdefault("close_error", _error(exc)["error"])


def _error(exc: BaseException) -> dict[str, str]:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return {"error": f"{type(exc).__name__}: {exc}",
            "where": " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))}


def run(size_gb: float, base: Path, keep: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every method in turn; ``keep`` gets the result so far after each (a later crash or
    timeout loses only what it was doing)."""
    import torch
    import torch.distributed as dist

    from slurmft.checkpoint.config import CheckpointConfig

    dist.init_process_group("gloo" if dev.smoke() else "cpu:gloo,cuda:nccl", init_method=f"file://{base / 'store'}",
                            rank=0, world_size=1)
    torch.manual_seed(0)
    model, optimizer = _model(size_gb)
    _step(model, optimizer, seed=1)
    tensors = _tensors(model, optimizer)
    out: dict[str, Any] = {"torch": torch.__version__, "gpu": None if dev.smoke() else torch.cuda.get_device_name(0),
                           "state_bytes": sum(t.numel() * t.element_size() for t in tensors),
                           "d2h_floor": _d2h_floor(tensors), "methods": {}}
    from _bench_slurmft import SlurmftSave

    for overlap in (False, True):
        run_dir = base / f"slurmft-overlap-{int(overlap)}"
        method = SlurmftSave(model, optimizer, run_dir, in_loop=overlap,
                             config=CheckpointConfig(keep_last=1, overlap=overlap))
        method.name = f"slurmft save, overlap={str(overlap).lower()}"
        try:
            out["methods"][method.name] = _summary(_series(method, model, optimizer, base, overlap))
        except Exception as exc:  # noqa: BLE001 - reported; the other methods still run
            out["methods"][method.name] = _error(exc)
        finally:
            _close(method, out["methods"][method.name])
        keep(out)
        if not overlap and "error" not in out["methods"][method.name]:
            try:
                out["restore"] = _restore_check(run_dir, model, optimizer, size_gb)
            except Exception as exc:  # noqa: BLE001
                out["restore"] = _error(exc)
            keep(out)
    try:
        from _bench_methods import THREAD, DcpAsyncSave
        from torch.distributed.checkpoint.staging import StagingOptions
    except ImportError as exc:
        out["dcp_error"] = f"dcp.async_save comparison unavailable on torch {torch.__version__}: {exc}"
        return out
    def pinned(async_staging: bool) -> StagingOptions:
        return StagingOptions(use_pinned_memory=not dev.smoke(), use_shared_memory=False,
                              use_async_staging=async_staging, use_non_blocking_copy=not dev.smoke())

    for label, options in (("dcp.async_save (defaults)", None),
                           ("dcp.async_save [pinned, non-blocking, reused stager]", pinned(False)),
                           ("dcp.async_save [pinned, non-blocking, async staging, reused stager]", pinned(True))):
        try:
            dcp_method = DcpAsyncSave(model, optimizer, label=label, options=options, checkpointer=THREAD)
        except Exception as exc:  # noqa: BLE001
            out["methods"][label] = _error(exc)
            continue
        try:
            out["methods"][label] = _summary(_series(dcp_method, model, optimizer, base / "dcp", False))
        except Exception as exc:  # noqa: BLE001
            out["methods"][label] = _error(exc)
        finally:
            _close(dcp_method, out["methods"][label])
        keep(out)
    dist.destroy_process_group()
    return out
