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
one step's state. After settling, changes are the next step's and harmless. A change made through
``tensor.data`` is not counted by torch and so not seen: ``fence()`` is the contract, this check
only catches the common ways of breaking it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from slurmft.train import torch_compat
from slurmft.train.save_thread import SaveWaitTimeout

# How often a bounded wait for a CUDA event looks at it (an event has no timed wait).
_EVENT_POLL_S = 0.0005


@dataclass
class CopyPair:
    """One live tensor (local shard), the host buffer it is copied into, and where it sits."""

    path: str
    src: torch.Tensor
    dst: torch.Tensor
    # The live tensor whose version counter is watched: the parameter or optimizer-state tensor
    # ``src`` aliases. State-dict helpers may hand out aliases made with ``.data`` (FSDP2 does),
    # which share the bytes but not the counter; None means ``src`` itself.
    live: torch.Tensor | None = None
    version: int = 0

    def watched(self) -> torch.Tensor:
        return self.src if self.live is None else self.live


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
            pair.version = torch_compat.version_of(pair.watched())
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
        while not self._event.query():
            if time.monotonic() > deadline:
                raise SaveWaitTimeout(f"the device-to-host copy of {self.what} not complete after "
                                      f"{timeout_s:g} s")
            time.sleep(_EVENT_POLL_S)

    def _settle(self) -> None:
        with self._lock:
            if self._settled:
                return
            self._settled = True
            self.copied_s = time.perf_counter() - self.started
            changed = [p.path for p in self._pairs if torch_compat.version_of(p.watched()) != p.version]
            if changed:
                shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
                self._problem = (f"{shown} changed while {self.what} was still copying it: change "
                                 f"model or optimizer state outside optimizer.step() only after "
                                 f"CheckpointManager.fence()")
            self._pairs = []  # the copy is over: do not keep the live tensors referenced
