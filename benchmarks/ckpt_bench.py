"""Checkpoint benchmark: slurmft's async save against torch.save, dcp.save and dcp.async_save.

    python benchmarks/ckpt_bench.py [--size-gb 1.0] [--saves 3] [--dir DIR] [--json]

Starts its own 2 ranks (gloo, CPU), builds one FSDP2 model + Adam state of ``--size-gb`` across
them, and saves that same state to the same disk with every method, a warm-up save and then
``--saves`` measured saves each. It also measures, in the same run, the physical limits the
methods are judged against: a copy into preallocated buffers and a write + fsync of the same
bytes (both taken again just before every save, since a shared machine's disk speed changes from
minute to minute), a cold read back, and the manifest's hash. Last, the cost inside a real training
loop (``_bench_loop``): steps around a save minus the same steps without one, for slurmft and
every ``dcp.async_save`` configuration (DCP's best there: the least in-loop overhead); then the
bytes and time of slurmft's incremental saves against whole ones, for this pre-training state and
a fine-tuning one that is 90 % frozen (``_bench_incremental``); last, the node-local tier: how soon
a save is durable there against a write of the same bytes, and its in-loop cost with every save
copied to the run dir behind (``_bench_local_tier``). Prints markdown tables; ``--json``
prints one JSON object instead. This is a benchmark, not a test: it takes minutes at the default size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

WORLD_SIZE = 2
WARMUP_SAVES = 1


# ----------------------------------------------------------------------------- worker (one rank)


def _run_method(method, model, probe, base: Path | None, saves: int, *,
                on_saved: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Warm-up + measured saves of one method; per save, the slowest rank's times.

    Each save is preceded (outside its timing) by a copy probe and a write probe, so it can be
    compared with the machine as it was at that moment.
    """
    import torch.distributed as dist

    from _bench_limits import max_across_ranks, sum_across_ranks
    from _bench_state import MemorySampler, touch_parameters

    measured = []
    with MemorySampler() as memory:
        for i in range(WARMUP_SAVES + saves):
            path = base / f"save-{i}" if base is not None else None
            touch_parameters(model)
            copy_s, write_s = probe.copy(), probe.write()
            dist.barrier()
            t0 = time.perf_counter()
            method.start(i + 1, path)
            t_block = time.perf_counter()
            method.finish()
            t_done = time.perf_counter()
            committed = method.committed_after_s()
            blocking = max_across_ranks(t_block - t0)
            total = max_across_ranks(committed if committed is not None else t_done - t0)
            wall = max_across_ranks(t_done - t0)
            if on_saved is not None:
                on_saved(i + 1)
            if i >= WARMUP_SAVES:
                measured.append({"blocking_s": blocking, "total_s": total, "until_finish_returned_s": wall,
                                 "copy_s": copy_s, "write_s": write_s})
            dist.barrier()
            if path is not None and dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
        method.close()
    return {"saves": measured, "extra_mem_bytes": sum_across_ranks(memory.extra)}


def _measure_verify(ckpt_dir: Path, probe, drop_all: bool, rounds: int = 7) -> dict[str, Any]:
    """Cold read of the probe files (both ranks) then cold verify of the last slurmft checkpoint
    (rank 0, one process, as ``slurmft ckpt verify`` runs), ``rounds`` times (the
    disk's speed moves tens of percent between minutes; the ratio is the median of the pairs);
    then a warm verify."""
    import torch.distributed as dist

    from _bench_limits import evict_from_page_cache, measure_cold_read
    from slurmft.checkpoint.verify import verify_checkpoint

    files = [p for p in ckpt_dir.rglob("*") if p.is_file()]
    pairs = []
    report = None
    for _ in range(rounds):
        read_s, eviction = measure_cold_read(probe.path, drop_all=drop_all)
        evict_from_page_cache(files, drop_all=drop_all)
        verify_s = [0.0]
        if dist.get_rank() == 0:
            t0 = time.perf_counter()
            report = verify_checkpoint(ckpt_dir)
            verify_s[0] = time.perf_counter() - t0
            if not report.ok:
                raise RuntimeError(f"slurmft checkpoint failed verification: {report.problems}")
        dist.broadcast_object_list(verify_s, src=0)
        pairs.append({"read_s": read_s, "verify_s": verify_s[0]})
    out: list[Any] = [None]
    if dist.get_rank() == 0:
        t0 = time.perf_counter()
        verify_checkpoint(ckpt_dir)
        out[0] = {"pairs": pairs, "verify_warm_s": time.perf_counter() - t0,
                  "verify_bytes": report.bytes_checked, "eviction": eviction}
    dist.broadcast_object_list(out, src=0)
    return out[0]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from _bench_incremental import measure_incremental
    from _bench_local_tier import measure_local_tier
    from _bench_limits import DiskAndCopyProbe, measure_hash, sum_across_ranks
    from _bench_methods import (DCP_ASYNC_CANDIDATES, DCP_ASYNC_DEFAULT, DcpSave, TorchSaveRank0,
                                dcp_async_method)
    from _bench_slurmft import SlurmftSave
    from _bench_state import build_state, local_tensors, nbytes, rss_bytes
    from slurmft.checkpoint.manifest import HASH_ALGO, StreamHasher

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=args.collective_timeout))
    base = Path(args.dir)
    model, optimizer = build_state(int(args.size_gb * (1 << 30)))
    tensors = local_tensors(model, optimizer)
    probe = DiskAndCopyProbe(tensors, base / f"probe-rank{args.rank}.bin")
    raw: dict[str, Any] = {"state_bytes": sum_across_ranks(nbytes(tensors)), "world_size": WORLD_SIZE,
                           "methods": {}, "hash_s": measure_hash(tensors, StreamHasher),
                           "hash_algo": HASH_ALGO}
    drop_all = args.evict == "drop_caches"

    # slurmft first: it also runs the RSS-growth series and leaves a checkpoint to verify.
    slurmft = SlurmftSave(model, optimizer, base / "slurmft-run")
    rss: dict[int, int] = {}
    n_slurmft = max(args.saves, args.rss_saves - WARMUP_SAVES)
    result = _run_method(slurmft, model, probe, None, n_slurmft,
                         on_saved=lambda step: rss.__setitem__(step, rss_bytes()))
    raw["methods"][slurmft.name] = {**result, "kind": "slurmft"}
    raw["slurmft"] = {"rss_first": _max_int(rss[1]), "rss_last": _max_int(rss[max(rss)]),
                      "rss_saves": max(rss)}
    raw["verify"] = _measure_verify(slurmft.last_checkpoint_dir(), probe, drop_all)
    dist.barrier()
    if args.rank == 0:
        shutil.rmtree(base / "slurmft-run", ignore_errors=True)

    for method in (TorchSaveRank0(model, optimizer), DcpSave(model, optimizer)):
        raw["methods"][method.name] = {**_run_method(method, model, probe, base / "m", args.saves),
                                       "kind": "sync"}
    # process-based ones last: their checkpoint daemon outlives the method
    for spec in (DCP_ASYNC_DEFAULT, *DCP_ASYNC_CANDIDATES):
        method = dcp_async_method(model, optimizer, spec)
        raw["methods"][method.name] = {**_run_method(method, model, probe, base / "m", args.saves),
                                       "kind": "dcp_async"}
    raw["in_loop"] = _in_loop(model, optimizer, probe, base, args.saves)
    raw["local_tier"] = measure_local_tier(model, optimizer, probe, base,
                                           Path(args.local_dir) if args.local_dir else base / "local", args.saves)
    probe.remove()
    raw["incremental"] = measure_incremental((model, optimizer), int(args.size_gb * (1 << 30)), base, args.saves)
    if args.rank == 0:
        Path(args.result).write_text(json.dumps(raw))
    dist.barrier()
    dist.destroy_process_group()


def _in_loop(model, optimizer, probe, base: Path, saves: int) -> dict[str, Any]:
    """The in-loop phase for slurmft and every dcp.async_save configuration (the summary picks the
    one with the least in-loop overhead as DCP's best)."""
    import torch.distributed as dist

    from _bench_loop import measure_in_loop
    from _bench_methods import DCP_ASYNC_CANDIDATES, DCP_ASYNC_DEFAULT, dcp_async_method
    from _bench_slurmft import SlurmftSave

    out: dict[str, Any] = {"methods": {}}
    slurmft = SlurmftSave(model, optimizer, base / "slurmft-loop", in_loop=True)
    out["methods"][slurmft.name] = {**measure_in_loop(slurmft, model, optimizer, probe, None, saves),
                                    "kind": "slurmft"}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(base / "slurmft-loop", ignore_errors=True)
    for spec in (DCP_ASYNC_DEFAULT, *DCP_ASYNC_CANDIDATES):
        method = dcp_async_method(model, optimizer, spec, in_loop=True)
        out["methods"][method.name] = {**measure_in_loop(method, model, optimizer, probe, base / "m", saves),
                                       "kind": "dcp_defaults" if spec is DCP_ASYNC_DEFAULT else "dcp_async"}
    return out


def _max_int(value: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# ----------------------------------------------------------------------------- launcher


def _launch(args: argparse.Namespace) -> dict[str, Any]:
    """Start the ranks as subprocesses, wait (bounded), return rank 0's raw result."""
    base = Path(args.dir) if args.dir else None
    with tempfile.TemporaryDirectory(prefix="slurmft-ckpt-bench-", dir=base) as work:
        work_path = Path(work)
        result = work_path / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                            os.environ.get("PYTHONPATH")]))}
        procs, logs = [], []
        for rank in range(WORLD_SIZE):
            argv = [sys.executable, str(Path(__file__).resolve()), "--_rank", str(rank),
                    "--_store", str(work_path / "store"), "--_result", str(result),
                    "--dir", str(work_path), "--size-gb", repr(args.size_gb),
                    "--saves", str(args.saves), "--rss-saves", str(args.rss_saves),
                    "--collective-timeout", str(args.collective_timeout), "--evict", args.evict,
                    *(["--local-dir", args.local_dir] if args.local_dir else [])]
            logs.append(work_path / f"rank{rank}.log")
            with open(logs[-1], "wb") as log:
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.timeout
        try:
            for proc in procs:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                if rc != 0:
                    raise SystemExit(f"ckpt_bench: rank process {proc.args[3]} exited with {rc}\n"
                                     + _log_tails(logs))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"ckpt_bench: ranks did not finish within --timeout {args.timeout} s\n"
                             + _log_tails(logs)) from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        return json.loads(result.read_text())


def _log_tails(logs: list[Path], lines: int = 25) -> str:
    out = []
    for log in logs:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(out)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0,
                   help="model + optimizer state across both ranks, GiB (default 1.0)")
    p.add_argument("--saves", type=int, default=3, help="measured saves per method (default 3)")
    p.add_argument("--rss-saves", type=int, default=20,
                   help="slurmft saves over which RSS growth is checked (default 20)")
    p.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir)")
    p.add_argument("--evict", choices=("drop_caches", "fadvise"), default="drop_caches",
                   help="how to make reads cold: drop the whole page cache (root; falls back to "
                        "fadvise when refused) or fadvise(DONTNEED) the files read (default drop_caches)")
    p.add_argument("--local-dir", default=None,
                   help="node-local disk for the local-tier phase (default: inside --dir, the same disk)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the run is killed")
    p.add_argument("--collective-timeout", type=float, default=900,
                   help="seconds any collective may take before the ranks fail")
    p.add_argument("--_rank", dest="rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_store", dest="store", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", dest="result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.size_gb <= 0:
        p.error(f"--size-gb must be > 0, got {args.size_gb}")
    if args.saves < 1:
        p.error(f"--saves must be >= 1, got {args.saves}")
    if args.rss_saves < 2:
        p.error(f"--rss-saves must be >= 2, got {args.rss_saves}")
    if args.dir is not None and not Path(args.dir).is_dir():
        p.error(f"--dir {args.dir} is not a directory")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.rank is not None:
        _worker(args)
        return
    from _bench_report import render, summarize

    summary = summarize(_launch(args))
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(render(summary))


if __name__ == "__main__":
    main()
