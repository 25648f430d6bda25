"""How long ``CheckpointManager.save()`` blocks the training loop as a model's tensor count grows.

A real model's state has hundreds to thousands of tensors (a 70B Llama: ~720 parameters, each
with two AdamW moments), and the part of a save that blocks the loop walks them all in Python:
torch's ``get_state_dict`` (names, FSDP2/DTensor wrapping), then slurmft's staging (the buffers'
structure check, pairing each tensor with its buffer, the version counters the overlapped copy
is checked against). The bytes are copied later, beside the next step (``overlap``). This
measures that walk alone: tiny ``Linear(W, W)`` layers, as many as asked, each ``fully_shard``ed
(FSDP2) with AdamW, on one gloo rank in this process (the walk is per rank: more ranks do not
change it), ``--saves`` saves of each size after one to allocate the buffers. The other
checkpoint figures (bytes, disks, ranks) are ``ckpt_bench.py``'s.

Prints a table (median and fastest blocking time, and ``get_state_dict``'s share, each timed
alone), or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from slurmft.checkpoint.config import CheckpointConfig  # noqa: E402
from slurmft.checkpoint.manager import CheckpointManager  # noqa: E402
from slurmft.checkpoint.state import TrainState  # noqa: E402


def _ms(values: list[float]) -> tuple[float, float]:
    return round(1000 * statistics.median(values), 2), round(1000 * min(values), 2)


class SaveFailed(RuntimeError):
    pass


def measure(layers: int, width: int, saves: int, run_dir: Path) -> dict:
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, width)

    def step() -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on, as in any save after the first step
    state = TrainState(model, optimizer)
    # The defaults, not the environment's or a slurmft.toml's settings: the same save everywhere.
    manager = CheckpointManager(run_dir, CheckpointConfig(interval=1))
    blocking = []
    try:
        for i in range(saves + 1):
            step()
            started = time.perf_counter()
            saved = manager.save(i + 1, state)
            took = time.perf_counter() - started
            manager.wait()
            last = manager.stats[-1] if manager.stats else None
            if not saved or last is None or last.step != i + 1 or not last.committed:
                raise SaveFailed(f"the save of step {i + 1} ({layers} layers) did not commit: "
                                 f"{getattr(last, 'error', None) or 'skipped'}")
            if i:  # the first allocates the staging buffers
                blocking.append(took)
    finally:
        manager.close()
    walks = []
    for _ in range(saves):
        started = time.perf_counter()
        get_state_dict(model, optimizer)
        walks.append(time.perf_counter() - started)
    tensors = sum(1 for _ in model.parameters())
    median, fastest = _ms(blocking)
    return {"layers": layers, "parameters": tensors, "committed_saves": saves + 1,
            "blocking_ms_median": median,
            "blocking_ms_min": fastest, "get_state_dict_ms_median": _ms(walks)[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[10, 100, 500],
                   help="model sizes in Linear layers, two parameters each (default 10 100 500)")
    p.add_argument("--width", type=int, default=8, help="each layer's in and out features (8)")
    p.add_argument("--saves", type=int, default=15, help="measured saves per size (15)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(args.layers) < 1 or args.width < 1 or args.saves < 1:
        p.error("--layers, --width and --saves must be >= 1")
    warnings.filterwarnings("ignore")  # FSDP2 on CPU/gloo warns once per module
    logging.getLogger("slurmft").setLevel(logging.WARNING)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="slurmft-save-blocking-") as work:
            rows = [measure(n, args.width, args.saves, Path(work) / f"run{i}")
                    for i, n in enumerate(args.layers)]
    except SaveFailed as exc:
        print(f"save_blocking_bench: {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    result = {"torch": torch.__version__, "width": args.width, "saves": args.saves, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"save() blocking time, one rank, FSDP2 + AdamW, Linear({args.width}, {args.width}) layers, "
          f"{args.saves} saves each (torch {torch.__version__})")
    print("| parameters | blocking median ms | fastest ms | get_state_dict median ms |")
    print("| ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['parameters']} | {r['blocking_ms_median']} | {r['blocking_ms_min']} | "
              f"{r['get_state_dict_ms_median']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
