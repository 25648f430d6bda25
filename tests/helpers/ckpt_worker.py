"""One rank of a multi-process checkpoint test (gloo on CPU); started by tests/unit/test_checkpoint_dist.py.

Scenarios (argv[1]):
  reshard      FSDP2 model + Adam: load the latest checkpoint, compare the full (unsharded) state
               with the reference file the previous world size wrote, train one step, save, write
               the new reference.
  determinism  DDP model with dropout and python/numpy noise: train to --steps with a save every
               2 steps, appending each step's loss; --kill-at K sends SIGKILL to itself at step K.
  crash        FSDP2 model whose parameters equal the step: load the latest checkpoint, check the
               parameters, then save every step until the test kills it.
  skip         on_busy = "skip" with a save requested every step while saves are slow: every rank
               must skip the same steps (or the ranks would deadlock in mismatched collectives).
  overlap      FSDP2 model + Adam with the background staging copy slowed down: the step after a
               save starts at once, and the checkpoint must still hold the state after its own
               step; then rank 1 changes a parameter right after a save without fence(), and that
               save must fail on every rank.
  incremental  FSDP2 model with a frozen base and a trained head, incremental saves: load the
               latest checkpoint (whatever world size wrote it), compare with the reference the
               previous run wrote, then train and save two steps (whole, then incremental).
  tiered       FSDP2 model + Adam with the node-local tier (--local-dir, --nodes: each rank's node
               name): load the latest checkpoint from any tier, compare with the reference, then
               train and save every step up to --steps (copied to the run dir every
               --shared-interval steps), writing a reference per step.
Rank 0 writes results as JSON lines to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from slurmft.checkpoint.manager import CheckpointConfig, CheckpointManager
from slurmft.checkpoint.overlap import InFlightCopy
from slurmft.checkpoint.state import TrainState


class CountingSampler:
    def __init__(self) -> None:
        self.offset = 0

    def state_dict(self):
        return {"offset": self.offset}

    def load_state_dict(self, sd):
        self.offset = int(sd["offset"])


def emit(out: str, **record) -> None:
    if dist.get_rank() == 0:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
        os.close(fd)


def full_state(state: TrainState) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd, "offset": state.sampler.offset}


def same(a, b, path="") -> list[str]:
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [path]
        return [p for k in a for p in same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [path]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in same(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


def fsdp_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def reshard(args) -> None:
    model = fsdp_model(24)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState(model, opt, sampler=CountingSampler())
    manager = CheckpointManager(args.run_dir)
    loaded = manager.load_latest(state)
    mismatches: list[str] = []
    if loaded is not None:
        reference = torch.load(os.path.join(args.run_dir, f"ref_{loaded}.pt"), weights_only=True)
        mismatches = same(reference, full_state(state))
    step = (loaded or 0) + 1
    torch.manual_seed(1000 + step * 10 + dist.get_rank())
    model(torch.randn(6, 24)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    state.sampler.offset += 6 * dist.get_world_size()
    manager.save(step, state, block=True)
    reference = full_state(state)
    if dist.get_rank() == 0:
        torch.save(reference, os.path.join(args.run_dir, f"ref_{step}.pt"))
    manager.close()
    emit(args.out, loaded=loaded, saved=step, mismatches=mismatches, world=dist.get_world_size(),
         offset=state.sampler.offset)


def determinism(args) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    # Different seeds per rank, as real jobs have: per-rank RNG must come back per rank.
    torch.manual_seed(100 + dist.get_rank())
    state = TrainState(model, opt, sched, CountingSampler(), extras={"rank_seed_note": "per-rank"})
    manager = CheckpointManager(args.run_dir, CheckpointConfig(interval=2, keep_last=2))
    start = (manager.load_latest(state) or 0) + 1
    for step in range(start, args.steps + 1):
        x = torch.randn(8, 10) + float(np.random.rand()) + random.random()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state.sampler.offset += 8
        total = loss.detach().clone()
        dist.all_reduce(total)
        emit(args.out, step=step, loss=float(total), offset=state.sampler.offset)
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if manager.due(step):
            manager.save(step, state)
    manager.close()


def crash(args) -> None:
    model = fsdp_model(64)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler=CountingSampler())
    manager = CheckpointManager(args.run_dir, CheckpointConfig(keep_last=2))
    loaded = manager.load_latest(state)
    params_ok = all(bool((p.full_tensor() == (loaded or 0)).all()) for p in model.parameters()) if loaded else True
    emit(args.out, loaded=loaded, params_ok=params_ok, offset_ok=state.sampler.offset == 10 * (loaded or 0))
    step = loaded or 0
    while True:
        step += 1
        manager.fence()  # the parameters change outside optimizer.step()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        state.sampler.offset = 10 * step
        manager.save(step, state)
        if step == (loaded or 0) + 2 and dist.get_rank() == 0:
            manager.wait()  # the first save of this run has committed: tell the test it may kill
            open(args.ready, "w").close()
        time.sleep(0.01)


def skip(args) -> None:
    model = fsdp_model(64)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # on_commit runs on rank 0 only: a slow one keeps rank 0 busy after rank 1 is done, so
    # ranks deciding alone would disagree about skipping.
    manager = CheckpointManager(args.run_dir, CheckpointConfig(on_busy="skip", keep_last=100),
                                on_commit=lambda *_: time.sleep(0.05))
    saved = []
    for step in range(1, args.steps + 1):
        time.sleep(0.02)  # the "training step": shorter than a save, so some requests find one in flight
        if manager.save(step, state):
            saved.append(step)
    manager.wait()
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, {"saved": saved, "skipped": manager.skipped,
                                   "committed": [s.step for s in manager.stats if s.committed]})
    manager.close()
    emit(args.out, views=views)


def _slow_background_copies(delay_s: float) -> None:
    finish = InFlightCopy.finish

    def slow_finish(self, timeout_s):
        time.sleep(delay_s)
        finish(self, timeout_s)

    InFlightCopy.finish = slow_finish


def overlap(args) -> None:
    _slow_background_copies(1.0)
    model = fsdp_model(96)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState(model, opt, sampler=CountingSampler())
    manager = CheckpointManager(args.run_dir, CheckpointConfig(keep_last=10))

    def train_step(step):
        torch.manual_seed(step * 10 + dist.get_rank())
        model(torch.randn(6, 96)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state.sampler.offset += 6

    for step in (1, 2):
        train_step(step)
    reference = copy.deepcopy(full_state(state))  # a CPU tensor (Adam's step) comes back un-copied
    manager.save(2, state)
    train_step(3)  # at once: Adam's step waits in its pre-hook until the copy is complete
    manager.wait()
    saved = manager.stats[-1]
    after_3 = full_state(state)
    fresh = TrainState(fsdp_model(96), None, sampler=CountingSampler())
    fresh.optimizer = torch.optim.Adam(fresh.model.parameters(), lr=1e-2)
    loaded = CheckpointManager(args.run_dir).load_latest(fresh)
    mismatches = same(reference, full_state(fresh))
    moved = bool(same(reference, after_3))  # step 3 really changed the state the copy read

    manager.save(4, state)
    if dist.get_rank() == 1:
        with torch.no_grad():
            next(iter(model.parameters())).mul_(2.0)  # on the DTensor itself, no fence: a racing change
    manager.wait()
    unfenced = manager.stats[-1]
    failed = [False]
    failed_all = torch.tensor([0 if unfenced.committed else 1])
    dist.all_reduce(failed_all)
    failed[0] = int(failed_all) == dist.get_world_size()
    manager.close()
    emit(args.out, loaded=loaded, mismatches=mismatches, moved=moved, blocking_s=saved.blocking_s,
         copied_s=saved.copied_s, fenced_s=saved.fenced_s, committed=saved.committed,
         unfenced_failed_everywhere=failed[0], unfenced_error=unfenced.error,
         step4=os.path.exists(os.path.join(args.run_dir, "checkpoints", "step_000000004")))


def incremental(args) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 384), torch.nn.Tanh(), torch.nn.Linear(384, 5))
    model[0].requires_grad_(False)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model[2].parameters(), lr=1e-2)
    state = TrainState(model, opt, sampler=CountingSampler())
    manager = CheckpointManager(args.run_dir, CheckpointConfig(keep_last=10, incremental=True))
    loaded = manager.load_latest(state)
    mismatches: list[str] = []
    if loaded is not None:
        reference = torch.load(os.path.join(args.run_dir, f"ref_{loaded}.pt"), weights_only=True)
        mismatches = same(reference, full_state(state))
    first = (loaded or 0) + 1
    for step in (first, first + 1):
        torch.manual_seed(step * 10 + dist.get_rank())
        model(torch.randn(6, 96)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state.sampler.offset += 6
        manager.save(step, state, block=True)
    reference = full_state(state)
    if dist.get_rank() == 0:
        torch.save(reference, os.path.join(args.run_dir, f"ref_{first + 1}.pt"))
    stats = manager.stats
    manager.close()
    emit(args.out, loaded=loaded, mismatches=mismatches, world=dist.get_world_size(),
         written=[s.bytes_written for s in stats], reused=[s.bytes_reused for s in stats])


def tiered(args) -> None:
    os.environ["SLURMD_NODENAME"] = args.nodes.split(",")[dist.get_rank()]
    model = fsdp_model(48)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState(model, opt, sampler=CountingSampler())
    config = CheckpointConfig(keep_last=10, local_dir=args.local_dir, keep_local=2,
                              shared_interval=args.shared_interval)
    manager = CheckpointManager(args.run_dir, config)
    loaded = manager.load_latest(state)
    mismatches: list[str] = []
    if loaded is not None:
        reference = torch.load(os.path.join(args.run_dir, f"ref_{loaded}.pt"), weights_only=True)
        mismatches = same(reference, full_state(state))
    emit(args.out, loaded=loaded, mismatches=mismatches, world=dist.get_world_size())
    for step in range((loaded or 0) + 1, args.steps + 1):
        torch.manual_seed(step * 10 + dist.get_rank())
        model(torch.randn(6, 48)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state.sampler.offset += 6
        reference = full_state(state)
        if dist.get_rank() == 0:
            torch.save(reference, os.path.join(args.run_dir, f"ref_{step}.pt"))
        manager.save(step, state)
        manager.wait()
        last = manager.stats[-1]
        emit(args.out, step=step, tier=last.tier, committed=last.committed, error=last.error)
    manager.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["reshard", "determinism", "crash", "skip", "overlap", "incremental",
                                                 "tiered"])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--ready", default="")
    parser.add_argument("--local-dir", default="")
    parser.add_argument("--nodes", default="")
    parser.add_argument("--shared-interval", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        {"reshard": reshard, "determinism": determinism, "crash": crash, "skip": skip,
         "overlap": overlap, "incremental": incremental, "tiered": tiered}[args.scenario](args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
