"""One rank of ``gpu_check.py``'s NCCL and warm-worker parts: a world of 1 on GPU 0, NCCL backend,
trained through ``slurmft.train.Run``.

    python benchmarks/_gpu_train.py --steps N --interval K --out result.json [--expect-step S]
           [--compare state.pt] [--dump state.pt]

The environment is torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and
``SLURMFT_RUN_DIR``. Per step it times ``report()`` alone (after a ``cuda.synchronize()``, so the
step's own GPU work is not counted in it: ``report()`` ends with a host sync of its own) and the
whole step, then, after the loop, a bare NCCL all-reduce of the same 3 float64 values report()
reduces (world 1: no wire, the floor of the collective). ``--dump`` writes the model and
optimizer state after the last step (the final checkpoint's state); ``--compare`` checks, right
after ``Run`` started (resumed), that the restored state equals such a file bit for bit.
``--extra N`` runs N steps past the restored one instead of up to ``--steps``. ``marks`` holds
the wall time of each phase of the start (``launched``: ``GPU_CHECK_T0`` from the parent, just
before it started this rank; ``main``; ``imports``; ``cuda``: the context made; ``pg``: NCCL's
communicator up (one all-reduce); ``model``; ``restored``: ``Run`` entered; ``first_step`` and
``second_step``, each after a sync), for the restart part.
Writes one JSON object to ``--out``; exits with Run's own code (85/86/...) when Run ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def _flat(state: dict, prefix: str = "") -> dict:
    import torch

    out = {}
    for key, value in state.items():
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name))
        elif isinstance(value, torch.Tensor):
            out[name] = value
    return out


def _state(model, optimizer) -> dict:
    return _flat({"model": model.state_dict(), "optim": optimizer.state_dict()["state"]})


def _mismatches(model, optimizer, path: Path) -> list[str]:
    import torch

    want = torch.load(path, map_location="cpu", weights_only=True)  # AdamW's "step" lives on the CPU
    have = _state(model, optimizer)
    bad = sorted(set(want) ^ set(have))
    bad += [k for k in sorted(set(want) & set(have))
            if want[k].dtype != have[k].dtype or not torch.equal(want[k].to(have[k].device), have[k])]
    return bad


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--extra", type=int, default=None, help="steps past the restored one (overrides --steps)")
    p.add_argument("--interval", type=int, required=True)
    p.add_argument("--width", type=int, default=None, help="(default 4096; 256 in a CPU smoke run)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--expect-step", type=int, default=None)
    p.add_argument("--compare", type=Path, default=None)
    p.add_argument("--dump", type=Path, default=None)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--crash-marker", type=Path, default=None)
    args = p.parse_args()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None:
        args.out = args.out.with_suffix(f".{restart}{args.out.suffix}")
    t_start = time.perf_counter()
    t0_env = os.environ.get("GPU_CHECK_T0")
    marks = {"launched": float(t0_env) if t0_env else None, "main": time.time()}
    result: dict = {"pid": os.getpid(), "ppid": os.getppid(),
                    "cuda_initialized_at_start": None, "marks": marks}
    import torch
    import torch.distributed as dist

    import _gpu_dev as dev
    from slurmft.train import CheckpointConfig, Run, RunConfig

    # A forked warm worker must find CUDA untouched (the server refuses otherwise).
    result["cuda_initialized_at_start"] = torch.cuda.is_initialized()
    result["import_s"] = time.perf_counter() - t_start
    marks["imports"] = time.time()
    if dev.smoke():
        marks["cuda"] = time.time()
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")
        dev.sync()
        marks["cuda"] = time.time()
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    dist.all_reduce(torch.zeros(1, device=dev.device()))
    dev.sync()
    marks["pg"] = time.time()
    result["backend"] = str(dist.get_backend())
    args.width = args.width or (256 if dev.smoke() else 4096)
    torch.manual_seed(1234)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)]).to(dev.device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dev.sync()
    marks["model"] = time.time()
    report_s, step_s = [], []
    with Run(model, optimizer, checkpoint=CheckpointConfig(interval=args.interval),
             config=RunConfig(heartbeat_interval_s=0, log_every=10)) as run:
        marks["restored"] = time.time()
        result["restored_step"] = run.restored_step
        if args.extra is not None:
            args.steps = (run.restored_step or 0) + args.extra
        result["device"] = str(run.device)
        if args.compare is not None:
            result["restore_mismatches"] = _mismatches(model, optimizer, args.compare)
        for step in run.steps(args.steps):
            if step == args.crash_at and args.crash_marker is not None and not args.crash_marker.exists():
                dev.sync()
                args.crash_marker.write_text(repr(time.time()))
                args.out.write_text(json.dumps(result))
                raise RuntimeError(f"gpu_check: the planned crash at step {step}")
            t0 = time.perf_counter()
            g = torch.Generator(device=dev.device()).manual_seed(step)
            x = torch.randn(256, args.width, device=dev.device(), generator=g)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            dev.sync()
            t1 = time.perf_counter()
            ok = run.report(loss=loss, grad_norm=norm)
            report_s.append(time.perf_counter() - t1)
            if ok:
                optimizer.step()
            optimizer.zero_grad()
            step_s.append(time.perf_counter() - t0)
            if len(step_s) <= 2:
                dev.sync()
                marks["first_step" if len(step_s) == 1 else "second_step"] = time.time()
        if args.dump is not None:
            torch.save(_state(model, optimizer), args.dump)
        saves = run.checkpoints.stats
        result["saves"] = [{"step": s.step, "committed": s.committed, "blocking_s": s.blocking_s,
                            "total_s": s.total_s, "stall_s": getattr(s, "stall_s", None),
                            "bytes": s.bytes_written, "error": s.error} for s in saves]
    values = torch.zeros(3, dtype=torch.float64, device=dev.device())
    bare = []
    for _ in range(50):
        dev.sync()
        t0 = time.perf_counter()
        dist.all_reduce(values)
        values.tolist()
        bare.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    med = statistics.median
    result.update(steps_run=len(step_s),
                  report_us_median=med(report_s[1:] or report_s) * 1e6 if report_s else None,
                  report_us_max=max(report_s) * 1e6 if report_s else None,
                  step_ms_median=med(step_s[1:] or step_s) * 1e3 if step_s else None,
                  bare_allreduce_us_median=med(bare[5:]) * 1e6)
    if args.expect_step is not None and result["restored_step"] != args.expect_step:
        result["error"] = f"restored step {result['restored_step']}, expected {args.expect_step}"
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
