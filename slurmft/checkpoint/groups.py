"""Process groups reserved for checkpointing, so its collectives never interleave with training's.

Two gloo groups over the checkpointing ranks, created once by every rank together:

* ``io``: used only by the background save thread (``dcp.save``) and by ``dcp.load``;
* ``control``: used only by the training thread, for the small agreements a checkpoint needs
  (is a save still in flight anywhere? which checkpoints to try? did they verify?).

Gloo keeps host tensors and runs beside NCCL, so none of this touches the training streams.
Without ``torch.distributed`` initialised, everything degrades to a single rank.

``destroy`` must run before interpreter teardown (``CheckpointManager.close`` does it, and at exit
for a manager never closed): a gloo worker thread frees a finished collective's tensors after the
caller saw it complete, and freeing one whose Python object is already gone takes the GIL. Once
Python 3.11 is finalizing, a thread asking for the GIL is ended with ``pthread_exit``, whose unwind
through that C++ destructor is ``std::terminate`` ("terminate called without an active
exception", SIGABRT). Destroying the groups joins their workers while the interpreter is whole.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from slurmft.checkpoint.torch_compat import destroy_group


class CheckpointGroups:
    def __init__(self, process_group: dist.ProcessGroup | None = None, *, timeout_s: float = 1800.0) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.io: dist.ProcessGroup | None = None
        self.control: dist.ProcessGroup | None = None
        self.rank, self.world_size = 0, 1
        if not self.distributed:
            return
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        timeout = timedelta(seconds=timeout_s)
        self.io = dist.new_group(ranks, timeout=timeout, backend="gloo")
        self.control = dist.new_group(ranks, timeout=timeout, backend="gloo")
        self.rank = dist.get_rank(self.control)
        self.world_size = dist.get_world_size(self.control)

    @property
    def closed(self) -> bool:
        return self.distributed and self.control is None

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def agree_busy(self, busy: bool) -> bool:
        """One all-reduce (MAX): whether any rank still has a save in flight."""
        if not self.distributed:
            return busy
        flag = torch.tensor([int(busy)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flag.item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box, control = [obj], self.control
        if control is None:
            raise RuntimeError("checkpoint groups used after destroy()")
        dist.broadcast_object_list(box, src=dist.get_global_rank(control, 0), group=control)
        return box[0]

    def union(self, items: list[str]) -> list[str]:
        """Every rank's strings merged (sorted, without duplicates) on every rank."""
        if not self.distributed:
            return sorted(set(items))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, items, group=self.control)
        return sorted({item for part in gathered for item in part})

    def destroy(self) -> None:
        """Destroy both groups; when it returns their gloo threads have been joined. Idempotent.

        Groups that a global ``dist.destroy_process_group()`` already unregistered are only let go:
        dropping the last reference is what destroys a group and joins its threads.
        """
        groups = [group for group in (self.io, self.control) if group is not None]
        self.io = self.control = None
        for group in groups:
            destroy_group(group)
