"""Staging: copy live model/optimizer state into host buffers that are allocated once and reused.

The training loop is blocked only while this copy runs; the background writer then reads the
copy while training changes the live parameters. Buffers are one empty host tensor per state
tensor, pinned when CUDA is in use (so device-to-host copies are fast and asynchronous), allocated
here rather than by DCP's ``_create_cpu_state_dict``, which deep-copies every CPU DTensor first (a
transient second copy of the state); they are refilled with DCP's ``_copy_state_dict``. Both the
DTensor wrapping and that copy are private torch APIs: without them (:mod:`slurmft.checkpoint.torch_compat`)
buffers of CPU-mesh DTensors are wrapped with ``DTensor.from_local`` and copied with a plain
``copy_``, and a state with DTensors on a device mesh is staged by DCP's public
``BlockingAsyncStager`` instead. They are re-allocated only when the
state's structure changes (e.g. optimizer state appears after the first step), so memory does not
grow from save to save; ``allocations`` counts how often that happened.

``stage_overlapped`` copies only what must not wait (all but parameters and optimizer state, e.g.
module buffers that a forward pass changes) before it returns, and hands the rest back as an
:class:`slurmft.checkpoint.overlap.InFlightCopy`: queued on a CUDA side stream (after everything already
queued on the tensors' device's current stream) into pinned buffers, or left for the save thread to copy on CPU. That
path uses plain ``copy_`` only; a state that needs DCP's public stager is staged before returning.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from slurmft.checkpoint import torch_compat
from slurmft.checkpoint.overlap import CopyPair, InFlightCopy, LiveState

log = logging.getLogger(__name__)

Signature = tuple[Any, ...]


def _signature(obj: Any) -> Signature:
    """Structure of a state dict: key paths, and for tensors dtype, local shape, device type.
    Built in one list (linear in the entries: a real model's state has thousands, and this runs
    in every save's blocking part), under ``no_grad`` (``to_local()`` under autograd costs ~10x)."""
    out: list[tuple[Any, ...]] = []
    with torch.no_grad():
        _collect_signature(obj, "", out)
    return tuple(out)


def _collect_signature(obj: Any, path: str, out: list[tuple[Any, ...]]) -> None:
    if isinstance(obj, DTensor):
        local = obj.to_local()
        out.append((path, "dtensor", local.dtype, tuple(local.shape), tuple(obj.shape), local.device.type))
    elif isinstance(obj, torch.Tensor):
        out.append((path, "tensor", obj.dtype, tuple(obj.shape), obj.device.type))
    elif isinstance(obj, dict):
        out.append((path, "dict", len(obj)))
        for key in sorted(obj, key=str):
            _collect_signature(obj[key], f"{path}/{key}", out)
    elif isinstance(obj, (list, tuple)):
        out.append((path, type(obj).__name__, len(obj)))
        for i, value in enumerate(obj):
            _collect_signature(value, f"{path}/{i}", out)
    else:
        out.append((path, "value"))  # ints, floats, strings: copied by value, not buffered


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


def _pair_up(src: Any, dst: Any, path: str, pairs: list[CopyPair]) -> Any:
    """``dst``'s structure with ``src``'s non-tensor values; every (source, buffer) into ``pairs``."""
    from torch.distributed.tensor import DTensor as _DTensor

    if isinstance(src, _DTensor):
        pairs.append(CopyPair(path, src.to_local(), dst.to_local()))
        return dst
    if isinstance(src, torch.Tensor):
        pairs.append(CopyPair(path, src, dst))
        return dst
    if isinstance(src, dict):
        return {key: _pair_up(value, dst[key], f"{path}/{key}", pairs) for key, value in src.items()}
    if isinstance(src, (list, tuple)):
        return type(src)(_pair_up(value, dst[i], f"{path}/{i}", pairs) for i, value in enumerate(src))
    return src


def _uses_cuda(signature: Signature) -> bool:
    return any(entry[-1] == "cuda" for entry in signature if entry[1] in ("tensor", "dtensor"))


class Stager:
    """Reusable host buffers for one state dict structure."""

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._signature: Signature | None = None
        self._pinned = False
        self._public: Any = None  # DCP's BlockingAsyncStager, when staging needs it
        self._stream: Any = None  # the CUDA side stream of overlapped copies
        self.allocations = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A host copy of ``state_dict`` in the reused buffers; returns when the copy is complete."""
        self._ensure_buffers(state_dict)
        if self._public is not None:
            self._buffers = self._public.stage(state_dict)
            return self._buffers
        assert self._buffers is not None  # set by _ensure_buffers; not user-triggerable
        staged = torch_compat.copy_state_dict(state_dict, self._buffers, non_blocking=self._pinned)
        if self._pinned:
            torch.cuda.synchronize()
        return staged

    def stage_overlapped(self, state_dict: dict[str, Any], live: LiveState,
                         what: str) -> tuple[dict[str, Any], InFlightCopy | None]:
        """The staged dict (buffers, filled once the returned copy is complete) and that copy.

        Tensors ``live`` calls deferrable (parameters, optimizer state) are left to the copy; every
        other one is copied before this returns. Without a version counter, with DCP's public
        stager, or with CUDA tensors on more than one device, everything is copied now and the
        copy is None.
        """
        self._ensure_buffers(state_dict)
        if self._public is not None or not torch_compat.VERSION_COUNTER:
            return self.stage(state_dict), None
        pairs: list[CopyPair] = []
        with torch.no_grad():
            staged = _pair_up(state_dict, self._buffers, "", pairs)
            devices = {pair.src.device for pair in pairs if pair.src.is_cuda}
            if len(devices) > 1:
                return self.stage(state_dict), None
            later = []
            for pair in pairs:
                if live.deferrable(pair.src):
                    pair.watched = live.watched(pair.src)
                    later.append(pair)
                else:  # queued (CUDA) or done (CPU) before the next forward can change it
                    pair.dst.copy_(pair.src, non_blocking=self._pinned)
            if not self._pinned or not devices:
                return staged, InFlightCopy(what, later)
            device = devices.pop()
            side = self._side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for pair in later:
                    pair.dst.copy_(pair.src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
        return staged, InFlightCopy(what, later, done)

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _ensure_buffers(self, state_dict: dict[str, Any]) -> None:
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
