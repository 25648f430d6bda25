"""Step fingerprints: short digests of what determines the next step, for the exact resume check.

A fingerprint is taken on rank 0 at the boundary after a step and rides on that step's ``loss``
event as ``fp`` (see :mod:`slurmft.train.resume_check` for how a resumed run compares them):

* ``rng`` (on saved steps, each segment's first step and the steps after a resume: reading
  NumPy's state is most of a fingerprint's cost): the global generators' state after the step (torch CPU, the current CUDA device when
  initialised, Python's ``random``, NumPy's legacy global): exactly what a checkpoint of this step
  saves, so the first step after a resume must start from it;
* ``in``: the inputs of the step's first forward pass (a forward pre-hook on the model ``Run``
  was given; positional and keyword tensors, their dtype, shape and bytes: the first 1 MiB of a CPU
  tensor, a weighted sum of the first 64 Ki elements of one on a GPU, computed there);
* ``smp``: the sampler's ``state_dict()`` after the step (JSON, so world-size independent for
  :class:`~slurmft.train.sampler.ResumableSampler`).

Each digest is 16 hex characters (blake2b, 8 bytes, over a CRC-32 of each large part: the parts
are not adversarial, and CRC-32 reads a batch's bytes several times faster). The pre-hook only works
when ``armed`` (one step in ``log_every`` plus the steps a check needs), so the steps between cost
one attribute test.
"""

from __future__ import annotations

import hashlib
import json
import random
import zlib
from typing import Any

import numpy as np
import torch

CPU_BYTES = 1 << 20    # bytes of a CPU input that are hashed (and its dtype and shape)
DEVICE_ELEMENTS = 1 << 16  # elements of a GPU input summed, weighted by position, on the GPU


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(zlib.crc32(part).to_bytes(4, "little") if len(part) > 256 else part)
    return h.hexdigest()


def rng_digest() -> str:
    """The global generators' state as one digest (a few tens of microseconds)."""
    _version, words, gauss = random.getstate()
    _name, keys, pos, has_gauss, np_gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    parts = [torch.get_rng_state().numpy().tobytes(), np.asarray(words, dtype=np.uint64).tobytes(),
             repr((gauss, int(pos), int(has_gauss), float(np_gauss))).encode(),
             np.asarray(keys).tobytes()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(torch.cuda.get_rng_state().numpy().tobytes())
    return _digest(*parts)


def state_digest(state: Any) -> str | None:
    """A digest of a ``state_dict()`` of plain JSON data; None when it is not JSON."""
    try:
        return _digest(json.dumps(state, sort_keys=True).encode())
    except (TypeError, ValueError):
        return None


def _tensors(value: Any, found: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for key in sorted(value, key=str):
            _tensors(value[key], found, depth + 1)


def _tensor_part(t: torch.Tensor) -> bytes | torch.Tensor:
    t = t.detach()
    if hasattr(t, "full_tensor"):  # a DTensor: this rank's shard is what it computes on
        t = t.to_local()  # type: ignore[attr-defined]
    if t.device.type == "cpu":
        flat = t.contiguous().reshape(-1)
        count = max(1, CPU_BYTES // max(flat.element_size(), 1))
        return flat[:count].view(torch.uint8).numpy().tobytes()
    flat = t.reshape(-1)[:DEVICE_ELEMENTS].to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
    return (flat * weights).sum()  # stays on the device until the boundary reads it


class InputDigest:
    """A forward pre-hook that digests the first forward's inputs of each armed step."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.armed = False
        self._parts: list[bytes | torch.Tensor] | None = None
        self._handle = module.register_forward_pre_hook(self._before, with_kwargs=True)

    def arm(self) -> None:
        """Digest the next forward's inputs (the first of the step)."""
        self.armed, self._parts = True, None

    def _before(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not self.armed or torch.compiler.is_compiling():
            return
        self.armed = False
        found: list[torch.Tensor] = []
        _tensors(list(args), found)
        _tensors(kwargs or {}, found)
        parts: list[bytes | torch.Tensor] = []
        for t in found:
            parts.append(f"{t.dtype}:{tuple(t.shape)}".encode())
            parts.append(_tensor_part(t))
        self._parts = parts

    def take(self) -> str | None:
        """The digest of the armed step's first forward (None: no forward ran, or not armed)."""
        parts, self._parts, self.armed = self._parts, None, False
        if parts is None:
            return None
        return _digest(*(p if isinstance(p, bytes) else repr(float(p.item())).encode() for p in parts))

    def remove(self) -> None:
        self._handle.remove()
