"""The save methods compared by ckpt_bench.py, each behind the same two-phase interface.

``start(step, path)`` returns when the training loop may change the parameters again (that is the
blocking time); ``finish()`` returns when the checkpoint is durable (and, for slurmft, committed).
Every method saves the same model + optimizer state of the same FSDP2 model to the same disk.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

# A checkpoint that does not finish within this many seconds fails the benchmark (no hang).
FINISH_TIMEOUT_S = 900


class SaveMethod:
    """Base: one way of saving the benchmark state."""

    name = ""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def sharded_state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def start(self, step: int, path: Path) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Block until the last started save is durable (synchronous methods are already)."""

    def committed_after_s(self) -> float | None:
        """Seconds from ``start`` to durable as the method itself timed it, if it keeps such stats
        (so work it does after committing, e.g. retention, is not counted); None: use the wall clock."""
        return None

    def close(self) -> None:
        """Release buffers, threads and processes this method holds."""


class TorchSaveRank0(SaveMethod):
    """Gather the full (unsharded) state on rank 0, ``torch.save`` it, fsync; everyone waits."""

    name = "torch.save (full state, rank 0)"

    def start(self, step: int, path: Path) -> None:
        model_sd, optim_sd = get_state_dict(
            self.model, self.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            with open(path / "state.pt", "wb") as fh:
                torch.save({"model": model_sd, "optim": optim_sd, "step": step}, fh)
                fh.flush()
                os.fsync(fh.fileno())
        del model_sd, optim_sd
        dist.barrier()


class DcpSave(SaveMethod):
    """``torch.distributed.checkpoint.save``: synchronous, sharded, fsynced by its writer."""

    name = "dcp.save"

    def start(self, step: int, path: Path) -> None:
        dcp.save(self.sharded_state(), checkpoint_id=str(path))


class DcpAsyncSave(SaveMethod):
    """``dcp.async_save`` with a given stager and checkpointer type.

    ``options=None`` means DCP's defaults (a fresh stager per call, buffers not reused). With
    options, one ``DefaultStager`` is kept across saves, so its cached staging buffers are reused.
    With asynchronous staging the loop may proceed once staging completes, not when the call returns:
    outside a loop ``start`` waits for it; in a loop (``in_loop=True``) the optimizer's step
    pre-hook does, as torchtitan waits for staging right before ``optimizer.step()``. Its
    collectives run on a gloo group of their own (as torchtitan's async checkpointing does), so a
    save planned in the background cannot interleave with the training loop's collectives.
    """

    def __init__(self, model, optimizer, *, label: str, options: StagingOptions | None,
                 checkpointer: AsyncCheckpointerType, in_loop: bool = False) -> None:
        super().__init__(model, optimizer)
        self.name = label
        self._staging: Future | None = None
        self._hook = optimizer.register_step_pre_hook(lambda *_: self._wait_for_staging()) if in_loop else None
        self._checkpointer = checkpointer
        self._stager = DefaultStager(options) if options is not None else None
        self._upload: Future | None = None
        self._group = dist.new_group(backend="gloo")

    def start(self, step: int, path: Path) -> None:
        response = dcp.async_save(
            self.sharded_state(), checkpoint_id=str(path),
            async_checkpointer_type=self._checkpointer, async_stager=self._stager,
            process_group=self._group,
        )
        if isinstance(response, AsyncSaveResponse):
            self._staging = response.staging_completion
            if self._hook is None:
                self._wait_for_staging()
            self._upload = response.upload_completion
        else:
            self._upload = response

    def _wait_for_staging(self) -> None:
        if self._staging is not None:
            self._staging.result(timeout=FINISH_TIMEOUT_S)
            self._staging = None

    def finish(self) -> None:
        self._wait_for_staging()
        if self._upload is not None:
            self._upload.result(timeout=FINISH_TIMEOUT_S)
            self._upload = None

    def close(self) -> None:
        self.finish()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def _staging(*, shared: bool, async_staging: bool) -> StagingOptions:
    # Pinned memory and non-blocking copies need an accelerator; this benchmark runs on CPU.
    return StagingOptions(use_pinned_memory=False, use_shared_memory=shared,
                          use_async_staging=async_staging, use_non_blocking_copy=False)


THREAD = AsyncCheckpointerType.THREAD
PROCESS = AsyncCheckpointerType.PROCESS

# (label, staging options or None for DCP's defaults, checkpointer type). The first is "defaults";
# the rest are the candidates for "best": the one with the lowest median blocking time is reported.
DCP_ASYNC_DEFAULT = ("dcp.async_save (defaults)", None, THREAD)
DCP_ASYNC_CANDIDATES = [
    ("thread, reused stager", _staging(shared=False, async_staging=False), THREAD),
    ("thread, reused stager, async staging", _staging(shared=False, async_staging=True), THREAD),
    ("process, default stager", None, PROCESS),
    ("process, reused shared-memory stager", _staging(shared=True, async_staging=False), PROCESS),
    ("process, reused shared-memory stager, async staging",
     _staging(shared=True, async_staging=True), PROCESS),
]


def method_label(spec: tuple) -> str:
    label = spec[0]
    return label if label.startswith("dcp.") else f"dcp.async_save [{label}]"


def dcp_async_method(model, optimizer, spec: tuple, *, in_loop: bool = False) -> DcpAsyncSave:
    _label, options, checkpointer = spec
    return DcpAsyncSave(model, optimizer, label=method_label(spec), options=options, checkpointer=checkpointer,
                        in_loop=in_loop)
