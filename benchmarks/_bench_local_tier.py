"""ckpt_bench's node-local tier phase: how soon a save is durable on the local disk, against a
write + fsync of the same bytes there, and what the background copy to the run dir costs the loop.

The two ranks pose as two nodes (``SLURMD_NODENAME``), each with its own local directory under
``--local-dir`` (default: inside the benchmark's directory, i.e. the same disk: on one machine the
"local" and "shared" tiers are one disk, so this measures the tier's own overhead, not a faster
disk). Two series of saves, each preceded by the write probe: without replicas (the save's own
bytes: the target's "state size / local write bandwidth") and with them (the default: every node
also writes one other node's shards, twice the bytes). Then the training loop with the local tier
copying every save to the run dir in the background, to compare with slurmft's plain in-loop cost.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from _bench_limits import DiskAndCopyProbe, max_across_ranks
from _bench_loop import measure_in_loop
from _bench_slurmft import SlurmftSave
from _bench_state import touch_parameters
from slurmft.checkpoint.manager import CheckpointConfig, CheckpointManager
from slurmft.checkpoint.state import TrainState

WARMUP_SAVES = 1  # the first save of a manager is also copied to the run dir


def _series(model, optimizer, probe: DiskAndCopyProbe, run_dir: Path, local_dir: str, saves: int, replicate: bool) -> list[dict]:
    # shared_interval this large: after the first save nothing is copied, only the local commit runs
    config = CheckpointConfig(keep_last=2, keep_local=2, local_dir=local_dir, replicate=replicate,
                              shared_interval=1 << 40)
    manager = CheckpointManager(run_dir, config)
    state = TrainState(model, optimizer)
    rows = []
    try:
        for i in range(WARMUP_SAVES + saves):
            touch_parameters(model)
            write_s = probe.write()
            dist.barrier()
            manager.save(i + 1, state)
            manager.fence()
            manager.wait()
            stats = manager.stats[-1]
            if not stats.committed or stats.local_s is None:
                raise RuntimeError(f"local-tier save of step {i + 1} failed: {stats.error}")
            if i >= WARMUP_SAVES:
                rows.append({"local_s": max_across_ranks(stats.local_s), "write_s": write_s,
                             "blocking_s": max_across_ranks(stats.blocking_s)})
    finally:
        manager.close()
    return rows


def measure_local_tier(model, optimizer, probe: DiskAndCopyProbe, base: Path, local_base: Path,
                       saves: int) -> dict[str, Any]:
    rank = dist.get_rank()
    os.environ["SLURMD_NODENAME"] = f"bench-node{rank}"  # two "nodes" on one machine
    local_base.mkdir(parents=True, exist_ok=True)
    local_dir = str(local_base / "{node}")
    local_probe = DiskAndCopyProbe(probe.tensors, local_base / f"probe-rank{rank}.bin")  # the local disk's write

    def clean(run_dir: Path) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
            for node_dir in local_base.glob("bench-node*"):
                shutil.rmtree(node_dir, ignore_errors=True)
        dist.barrier()

    out: dict[str, Any] = {"same_disk": os.stat(local_base).st_dev == os.stat(base).st_dev}
    for name, replicate in (("own", False), ("with_replica", True)):
        out[name] = _series(model, optimizer, local_probe, base / f"tier-{name}", local_dir, saves, replicate)
        clean(base / f"tier-{name}")
    loop = SlurmftSave(model, optimizer, base / "tier-loop", in_loop=True,
                       config=CheckpointConfig(keep_last=2, keep_local=2, local_dir=local_dir))
    out["in_loop"] = measure_in_loop(loop, model, optimizer, local_probe, None, saves)
    clean(base / "tier-loop")
    local_probe.remove()
    return out
