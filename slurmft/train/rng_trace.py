"""Which line of the user's moved a global random generator (or the sampler): a bounded line tracer.

A resume warning is only useful when it names the line to change. The fingerprints
(:mod:`slurmft.train.fingerprint`) say *that* the random state moved where no checkpoint sees it;
this module says *where*: :class:`DrawTracer` follows the user's own code (every file outside
slurmft, the standard library and the installed packages) line by line with ``sys.settrace`` and,
after each of those lines, compares the generators' state (torch CPU, the current CUDA device when
initialised, Python's ``random``, NumPy's legacy global, and the sampler given to ``Run``) with
the state after the line before. A line after which it changed drew: it is recorded as a
:class:`Draw` with the chain of the user's calls above it (``draw()`` at line 37, called from line
70). A draw inside a library (``torch.randn``, a ``DataLoader``) lands on the user's line that
called it.

It is a diagnostic, so it is bounded and never in the way:

* it traces only short windows ``Run`` picks: between the restore and the loop's first step (a
  few lines in every script seen), and one step after a divergence was found, to name the line
  (the step's forward passes are excluded: dropout draws there by design);
* at most ``max_checks`` lines are compared (each costs ~0.2 ms, NumPy's state read most of it)
  and ``max_events`` calls seen; past them it stops, and says so (``truncated``);
* it traces the thread that started it only, and not at all when a tracer is already installed
  (a debugger, coverage): that one keeps working and the warning names the window instead.
"""

from __future__ import annotations

import os
import random
import sys
import sysconfig
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any, Callable, cast

import numpy as np
import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = tuple(sorted({os.path.abspath(p) + os.sep for name in ("stdlib", "platstdlib", "purelib", "platlib")
                              if (p := sysconfig.get_paths().get(name))}))


def is_user_file(filename: str) -> bool:
    """The user's own code: a real file outside slurmft, the standard library and site-packages."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return not path.startswith(_PACKAGE) and not path.startswith(_LIBRARY_DIRS)


@dataclass(frozen=True)
class Draw:
    """One line of the user's after which ``moved`` generators had changed."""

    moved: tuple[str, ...]
    file: str
    line: int
    function: str
    callers: tuple[tuple[str, int], ...]  # the user's lines above it, innermost first
    in_forward_step: bool = False         # after the traced step's first forward pass

    @property
    def site(self) -> str:
        return f"{self.file}:{self.line}"

    def describe(self) -> str:
        """``t.py:37 (torch, in draw(), called from t.py:70)``."""
        inner = "/".join(self.moved)
        if self.callers:
            inner += f", in {self.function}(), called from " + ", from ".join(f"{f}:{n}" for f, n in self.callers)
        return f"{self.site} ({inner})"


def _state(sampler: Any) -> dict[str, Any]:
    # np.random's global RandomState is always MT19937: the legacy tuple (see boundary.py)
    legacy = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "python": random.getstate(),
        "numpy": (legacy[1].tobytes(), *legacy[2:]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    if sampler is not None:
        try:
            state["sampler"] = repr(sampler.state_dict())
        except Exception:  # noqa: BLE001 - a sampler that cannot say its state is simply not traced
            pass
    return state


@dataclass
class DrawTracer:
    """Records the user's lines that moved a generator between ``start()`` and ``stop()``."""

    sampler: Any = None
    max_checks: int = 5000
    max_events: int = 500_000
    draws: list[Draw] = field(default_factory=list)
    truncated: bool = False
    active: bool = False
    available: bool = True  # False: another tracer was installed, nothing was traced
    _forward_depth: int = 0
    _forward_seen: bool = False
    _checks: int = 0
    _events: int = 0
    _base: dict[str, Any] = field(default_factory=dict)
    _prev: tuple[FrameType, int] | None = None
    _user_code: dict[CodeType, bool] = field(default_factory=dict)
    _traced: list[FrameType] = field(default_factory=list)

    def start(self, skip: int = 1) -> "DrawTracer":
        """Trace from the caller ``skip`` frames up (and every user frame above it) on this thread."""
        if sys.gettrace() is not None:
            self.available = False
            return self
        self._base = _state(self.sampler)
        frame: FrameType | None = sys._getframe(skip)
        while frame is not None:
            if self._is_user(frame.f_code):
                frame.f_trace = self._local
                self._traced.append(frame)
                if self._prev is None:
                    self._prev = (frame, frame.f_lineno)
            frame = frame.f_back
        self.active = True
        sys.settrace(self._global)
        return self

    def stop(self) -> list[Draw]:
        """Stop tracing (idempotent); the draws seen, in order."""
        if self.active:
            self._check()  # what ran since the last line
            self._halt()
        return self.draws

    def forward_hooks(self, module: torch.nn.Module) -> Callable[[], None]:
        """Exclude ``module``'s forward passes (their draws are the step's own, in the checkpoint's
        RNG state); returns the function that removes the hooks."""
        def before(*_: Any) -> None:
            if self.active and self._forward_depth == 0:
                self._check()  # what the user's lines drew before this forward
            self._forward_depth += 1

        def after(*_: Any) -> None:
            self._forward_depth = max(0, self._forward_depth - 1)
            if self.active and self._forward_depth == 0:
                self._base = _state(self.sampler)  # the forward's own draws are not the user's lines'
                self._forward_seen = True

        handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

        def remove() -> None:
            for handle in handles:
                handle.remove()
        return remove

    # ------------------------------------------------------------------ the trace functions

    def _is_user(self, code: CodeType) -> bool:
        known = self._user_code.get(code)
        if known is None:
            known = self._user_code[code] = is_user_file(code.co_filename)
        return known

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        self._events += 1
        if self._events > self.max_events:
            self.truncated = True
            self._halt()
            return None
        if event != "call" or not self._is_user(frame.f_code):
            return None
        return self._local

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.active:
            return None
        if event in ("line", "return"):
            self._check()
            if self._checks >= self.max_checks:
                self.truncated = True
                self._halt()
                return None
            if event == "line":
                self._prev = (frame, frame.f_lineno)
            else:  # what runs next belongs to the user's line that called this function
                up = frame.f_back
                while up is not None and not self._is_user(up.f_code):
                    up = up.f_back
                self._prev = None if up is None else (up, up.f_lineno)
        return self._local

    def _check(self) -> None:
        self._checks += 1
        if self._forward_depth:
            return
        now = _state(self.sampler)
        moved = tuple(name for name, value in self._base.items() if now.get(name, value) != value)
        self._base = now
        if not moved or self._prev is None:
            return
        frame, line = self._prev
        callers: list[tuple[str, int]] = []
        up = frame.f_back
        while up is not None and len(callers) < 2:
            if self._is_user(up.f_code):
                callers.append((up.f_code.co_filename, up.f_lineno))
            up = up.f_back
        self.draws.append(Draw(moved, frame.f_code.co_filename, line, frame.f_code.co_name,
                               tuple(callers), self._forward_seen))

    def _halt(self) -> None:
        self.active = False
        if sys.gettrace() == self._global:  # a debugger started since keeps its own tracer
            sys.settrace(None)
        for frame in self._traced:
            frame.f_trace = None
        self._traced.clear()
        self._prev = None
