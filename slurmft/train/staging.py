"""Staging: copy live model/optimizer state into host buffers that are allocated once and reused.

The training loop is blocked only while this copy runs; the background writer then reads the
copy while training changes the live parameters. Buffers are one empty host tensor per state
tensor, pinned when CUDA is in use (so device-to-host copies are fast and asynchronous), allocated
here rather than by DCP's ``_create_cpu_state_dict``, which deep-copies every CPU DTensor first (a
transient second copy of the state); they are refilled with DCP's ``_copy_state_dict``. Both the
DTensor wrapping and that copy are private torch APIs: without them (:mod:`slurmft.train.torch_compat`)
buffers of CPU-mesh DTensors are wrapped with ``DTensor.from_local`` and copied with a plain
``copy_``, and a state with DTensors on a device mesh is staged by DCP's public
``BlockingAsyncStager`` instead. They are re-allocated only when the
state's structure changes (e.g. optimizer state appears after the first step), so memory does not
grow from save to save; ``allocations`` counts how often that happened.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from slurmft.train import torch_compat

log = logging.getLogger(__name__)

Signature = tuple[Any, ...]


def _signature(obj: Any, path: str = "") -> Signature:
    """Structure of a state dict: key paths, and for tensors dtype, local shape, device type."""
    if isinstance(obj, DTensor):
        local = obj.to_local()
        return ((path, "dtensor", local.dtype, tuple(local.shape), tuple(obj.shape), local.device.type),)
    if isinstance(obj, torch.Tensor):
        return ((path, "tensor", obj.dtype, tuple(obj.shape), obj.device.type),)
    if isinstance(obj, dict):
        out: tuple[Any, ...] = ((path, "dict", len(obj)),)
        for key in sorted(obj, key=str):
            out += _signature(obj[key], f"{path}/{key}")
        return out
    if isinstance(obj, (list, tuple)):
        out = ((path, type(obj).__name__, len(obj)),)
        for i, value in enumerate(obj):
            out += _signature(value, f"{path}/{i}")
        return out
    return ((path, "value"),)  # ints, floats, strings: copied by value, not buffered


def _empty_host_like(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="cpu", pin_memory=pin)


class _NeedsPublicStager(Exception):
    """A DTensor buffer cannot be made without the private constructor (see torch_compat)."""


def _allocate_like(obj: Any, pin: bool) -> Any:
    """Host buffers with ``obj``'s structure; values that are not tensors are kept as they are."""
    if isinstance(obj, DTensor):
        # Same spec (mesh, placements, global shape) around a host-side local tensor, as DCP's
        # stager produces; DTensor.from_local would move the buffer to the mesh's device.
        staged = torch_compat.host_dtensor_like(obj, _empty_host_like(obj.to_local(), pin))
        if staged is None:
            raise _NeedsPublicStager
        return staged
    if isinstance(obj, torch.Tensor):
        return _empty_host_like(obj, pin)
    if isinstance(obj, dict):
        return {key: _allocate_like(value, pin) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_allocate_like(value, pin) for value in obj)
    return obj


def _uses_cuda(signature: Signature) -> bool:
    return any(entry[-1] == "cuda" for entry in signature if entry[1] in ("tensor", "dtensor"))


class Stager:
    """Reusable host buffers for one state dict structure."""

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._signature: Signature | None = None
        self._pinned = False
        self._public: Any = None  # DCP's BlockingAsyncStager, when staging needs it
        self.allocations = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A host copy of ``state_dict`` in the reused buffers; returns when the copy is complete."""
        signature = _signature(state_dict)
        if signature != self._signature:
            if self._signature is not None:
                log.info("checkpoint state structure changed; re-allocating staging buffers")
            self._pinned = _uses_cuda(signature)
            self._buffers = self._public = None  # drop the old buffers before allocating new ones
            try:
                self._buffers = _allocate_like(state_dict, self._pinned)
            except _NeedsPublicStager:
                self._public = torch_compat.public_stager()
            self._signature = signature
            self.allocations += 1
        if self._public is not None:
            self._buffers = self._public.stage(state_dict)
            return self._buffers
        assert self._buffers is not None  # set just above; not user-triggerable
        staged = torch_compat.copy_state_dict(state_dict, self._buffers, non_blocking=self._pinned)
        if self._pinned:
            torch.cuda.synchronize()
        return staged

    def buffer_pointers(self) -> list[int]:
        """Data pointers of every staging buffer (tests check they do not change across saves)."""
        ptrs: list[int] = []

        def walk(obj: Any) -> None:
            if isinstance(obj, DTensor):
                ptrs.append(obj.to_local().data_ptr())
            elif isinstance(obj, torch.Tensor):
                ptrs.append(obj.data_ptr())
            elif isinstance(obj, dict):
                for value in obj.values():
                    walk(value)
            elif isinstance(obj, (list, tuple)):
                for value in obj:
                    walk(value)

        walk(self._buffers)
        return ptrs
