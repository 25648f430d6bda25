"""ResumableSampler: which samples each rank trains on, addressed by a GLOBAL sample offset.

The data order is a pure function of (seed, epoch, dataset length, global batch size): epoch
``e`` is a permutation of the dataset seeded by ``(seed, e)``, cut into global batches of
``global_batch_size`` samples (the tail that does not fill a batch is dropped). Global step ``k``
is the ``k``-th global batch of that stream. Each rank takes a contiguous slice of the global
batch and cuts it into micro-batches (gradient accumulation), so the world size only decides who
computes what, never which samples a step sees. The position saved in a checkpoint is the number
of samples handed out: after a restart on any world size the run continues at the next unseen
sample, none repeated or skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

STATE_VERSION = 1


class SamplerError(ValueError):
    """The batch geometry or a restored position cannot work; the message says why."""


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is split: per rank, then into micro-batches."""

    global_batch_size: int
    world_size: int
    micro_batch_size: int

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def accumulation_steps(self) -> int:
        return self.per_rank // self.micro_batch_size

    @classmethod
    def make(cls, global_batch_size: int, world_size: int, micro_batch_size: int | None) -> "BatchPlan":
        if global_batch_size < 1 or world_size < 1:
            raise SamplerError(f"global batch size ({global_batch_size}) and world size "
                               f"({world_size}) must be >= 1")
        if global_batch_size % world_size:
            raise SamplerError(
                f"global batch size {global_batch_size} is not divisible by the world size "
                f"{world_size}: choose a global batch that every world size you may restart on divides")
        per_rank = global_batch_size // world_size
        micro = per_rank if micro_batch_size is None else micro_batch_size
        if micro < 1 or per_rank % micro:
            raise SamplerError(
                f"per-rank batch {per_rank} (global {global_batch_size} / world {world_size}) is not "
                f"divisible by the micro-batch size {micro}")
        return cls(global_batch_size, world_size, micro)


def epoch_order(dataset_len: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The sample order of one epoch: a permutation seeded by (seed, epoch), or 0..n-1."""
    if not shuffle:
        return list(range(dataset_len))
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + epoch) % (2**63))
    return torch.randperm(dataset_len, generator=gen).tolist()


class ResumableSampler:
    """Hands each rank its micro-batches step by step; position = global samples consumed.

    dataset_len: samples in the dataset. global_batch_size: samples per step over all ranks.
    rank, world_size: this rank's slice. micro_batch_size: per-rank micro-batch (default: the whole
    per-rank batch, no accumulation). seed: the data order's seed (0). shuffle: permute each epoch (True).
    """

    def __init__(self, dataset_len: int, global_batch_size: int, *, rank: int, world_size: int,
                 micro_batch_size: int | None = None, seed: int = 0, shuffle: bool = True) -> None:
        if dataset_len < global_batch_size:
            raise SamplerError(f"dataset has {dataset_len} samples, fewer than one global batch "
                               f"({global_batch_size})")
        if not 0 <= rank < world_size:
            raise SamplerError(f"rank {rank} is outside the world size {world_size}")
        self.plan = BatchPlan.make(global_batch_size, world_size, micro_batch_size)
        self.dataset_len = dataset_len
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_len // self.plan.global_batch_size

    @property
    def step(self) -> int:
        """Global steps handed out so far (== the training step when one call per step)."""
        return self.consumed // self.plan.global_batch_size

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def global_batch(self, step: int) -> list[int]:
        """All sample indices of global step ``step``, in order (the same on every rank)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._order_epoch:
            self._order = epoch_order(self.dataset_len, self.seed, epoch, self.shuffle)
            self._order_epoch = epoch
        start = within * self.plan.global_batch_size
        return self._order[start:start + self.plan.global_batch_size]

    def rank_batch(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of global step ``step``."""
        batch = self.global_batch(step)
        per_rank, micro = self.plan.per_rank, self.plan.micro_batch_size
        mine = batch[self.rank * per_rank:(self.rank + 1) * per_rank]
        return [mine[i:i + micro] for i in range(0, per_rank, micro)]

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next step; the position moves past the whole step."""
        micro_batches = self.rank_batch(self.step)
        self.consumed += self.plan.global_batch_size
        return micro_batches

    def __iter__(self) -> Iterator[list[list[int]]]:
        while True:
            yield self.next_step()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "consumed": self.consumed,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "global_batch_size": self.plan.global_batch_size,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; refuses a state whose data order differs from this sampler's."""
        if int(state.get("version", 0)) > STATE_VERSION:
            raise SamplerError(f"sampler state version {state.get('version')} is newer than this "
                               f"slurmft understands ({STATE_VERSION})")
        mine = self.state_dict()
        for key in ("seed", "dataset_len", "global_batch_size", "shuffle"):
            if int(state[key]) != mine[key]:
                raise SamplerError(
                    f"checkpointed sampler has {key}={int(state[key])} but this run has "
                    f"{key}={mine[key]}: resuming would change the data order")
        consumed = int(state["consumed"])
        if consumed < 0 or consumed % self.plan.global_batch_size:
            raise SamplerError(f"checkpointed sampler position {consumed} is not a whole number of "
                               f"global batches of {self.plan.global_batch_size}")
        self.consumed = consumed
