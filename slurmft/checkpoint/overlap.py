"""The staging copy still in flight after ``save()`` returned, and the fence that guards it.

With overlapped staging a save copies into its host buffers while the next step's forward and
backward run: on CPU the save thread copies; on CUDA the copies run on a side stream into pinned
buffers and an event marks their end. Until the copy is complete the live tensors it reads must not
change. :class:`InFlightCopy` owns that window:

* ``fence()`` (the training thread: the optimizer's step pre-hook, or the user before changing state
  another way) returns once the copy is complete, waiting at most its bound;
* ``finish()`` (the save thread) runs the CPU copy, or waits for the CUDA event, before the bytes
  are written.

Whichever of the two sees the copy complete first *settles* it: every source tensor's version
counter (bumped by each in-place change, through the tensor or any view or ``.detach()`` of it) is
compared with its value when ``save()`` returned. A tensor changed in between (a loop that changed
state without ``fence()``) may have been copied half old, half new: the save then fails on every
rank (see ``CommitWriter``'s ``before_write``) instead of committing a checkpoint that does not hold
one step's state. After settling, changes are the next step's and harmless. Torch does not count
every change: not one made through ``tensor.data``, and on a DTensor (FSDP2) not the ``_foreach``
ops (the fused/foreach optimizers use them; the step pre-hook fences those). ``fence()`` is the
contract; this check catches the common ways of breaking it, and the manager copies before
``save()`` returns from then on once it caught one.

Only what a step changes in ``optimizer.step()`` is deferred (:class:`LiveState`: the parameters
and the optimizer's state tensors); every other tensor of the state dict (module buffers, which a
forward pass changes, a tensor learning rate a scheduler fills, copies ``get_state_dict`` made) is
copied before ``save()`` returns.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from slurmft.checkpoint import torch_compat
from slurmft.checkpoint.save_thread import SaveWaitTimeout

# A bounded wait for a CUDA event polls it (an event has no timed wait), backing off to the max.
_EVENT_POLL_S = (0.0005, 0.01)
# In the message of a save that failed because a change raced its copy (CheckpointManager reads it).
RACED = "was still copying it"


def optimizers_of(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The optimizers a TrainState holds: none, one, or a list of them (as DCP's helpers take)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return list(optimizer)
    return [optimizer]


class LiveState:
    """The live tensors a save may copy after it returned, by data pointer: parameters and
    optimizer state (local shards), each with every tensor whose version counter may move when
    it changes (a DTensor's own and its local tensor's: in-place ops on either count on one only).
    """

    def __init__(self, model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self._tensors: dict[int, tuple[torch.Tensor, ...]] = {}
        with torch.no_grad():  # to_local() under autograd costs ~10x more, per tensor
            for param in model.parameters():
                self._add(param)
            for optimizer in optimizers:
                for per_param in optimizer.state.values():
                    for value in per_param.values():
                        if isinstance(value, torch.Tensor):
                            self._add(value)

    def _add(self, tensor: torch.Tensor) -> None:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel():
            found = (tensor, local) if local is not tensor else (tensor,)
            self._tensors[local.data_ptr()] = self._tensors.get(local.data_ptr(), ()) + found

    def deferrable(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.numel()) and tensor.data_ptr() in self._tensors

    def watched(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._tensors.get(tensor.data_ptr(), ()) + (tensor,)


@dataclass
class CopyPair:
    """One live tensor (local shard), the host buffer it is copied into, and where it sits."""

    path: str
    src: torch.Tensor
    dst: torch.Tensor
    # The tensors whose version counters are watched: ``src`` and the live parameter or
    # optimizer-state tensor it aliases (state-dict helpers may hand out ``.data``-style aliases,
    # FSDP2's do, which share the bytes but not the counter).
    watched: tuple[torch.Tensor, ...] = ()
    versions: tuple[int, ...] = ()

    def current_versions(self) -> tuple[int, ...]:
        return tuple(torch_compat.version_of(t) for t in self.watched)


class InFlightCopy:
    """The deferred part of one save's staging copy (see the module docstring).

    what: names the save in messages. pairs: what to copy. event: a CUDA event recorded after the
    copies were queued on a side stream (they then already run), or None for a CPU copy that
    ``finish()`` makes.
    """

    def __init__(self, what: str, pairs: list[CopyPair], event: Any = None) -> None:
        self.what = what
        self._pairs = pairs
        for pair in pairs:
            pair.versions = pair.current_versions()
        self.nbytes = sum(p.src.numel() * p.src.element_size() for p in pairs)
        self._event = event
        self._lock = threading.Lock()
        self._settled = False
        self._problem: str | None = None
        self._done = threading.Event()
        self.started = time.perf_counter()
        self.copied_s: float | None = None  # from the save() call's copy start until complete
        self.fenced_s = 0.0  # how long the training thread waited in fence()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def problem(self) -> str | None:
        """Why the copy cannot be trusted (a source changed, or the copy failed); None when good."""
        with self._lock:
            return self._problem

    def finish(self, timeout_s: float) -> None:
        """Save thread: complete the copy (CPU) or wait for it (CUDA), then settle. Never raises:
        a failure is kept in ``problem``, so the save can fail on every rank together."""
        try:
            if self._event is None:
                with torch.no_grad():
                    for pair in self._pairs:
                        pair.dst.copy_(pair.src)
            else:
                self._wait_event(timeout_s)
            self._settle()
        except Exception as exc:
            with self._lock:
                self._settled = True
                self._problem = f"the staging copy failed: {type(exc).__name__}: {exc}"
                self._pairs = []
        finally:
            self._done.set()

    def fence(self, timeout_s: float) -> None:
        """Training thread: return once no live tensor is still being read, waiting at most
        ``timeout_s`` (then :class:`SaveWaitTimeout` names the save)."""
        if self._done.is_set():
            return
        waiting = time.perf_counter()
        try:
            if self._event is not None:
                self._wait_event(timeout_s)
                self._settle()
            elif not self._done.wait(timeout_s):
                raise SaveWaitTimeout(f"the state copy of {self.what} still in flight after waiting "
                                      f"{timeout_s:g} s: the save thread is stuck")
        finally:
            self.fenced_s += time.perf_counter() - waiting

    def _wait_event(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause, longest = _EVENT_POLL_S
        while not self._event.query():
            if time.monotonic() > deadline:
                raise SaveWaitTimeout(f"the device-to-host copy of {self.what} not complete after "
                                      f"{timeout_s:g} s")
            time.sleep(pause)
            pause = min(2 * pause, longest)

    def _settle(self) -> None:
        with self._lock:
            if self._settled:
                return
            self._settled = True
            self.copied_s = time.perf_counter() - self.started
            changed = [p.path for p in self._pairs if p.current_versions() != p.versions]
            if changed:
                shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
                self._problem = (f"{shown} changed while {self.what} {RACED}: change model or "
                                 f"optimizer state outside optimizer.step() only after "
                                 f"CheckpointManager.fence()")
            self._pairs = []  # the copy is over: do not keep the live tensors referenced


def trust(copy: InFlightCopy) -> None:
    """Called by the writer before it writes: the copy's problem fails the save (on every rank)."""
    if copy.problem is not None:
        raise RuntimeError(copy.problem)
