"""The step-boundary rule: randomness a resumed run can replay, and a check that warns when it cannot.

A checkpoint captures the state at a step boundary: everything the next step needs must be in
that state (model, optimizer, sampler position, RNG) and nothing may be drawn between the boundary
and the save. A batch drawn from a global RNG *before* the boundary and held in a variable (the
common "prefetch the next batch" loop) is in no checkpoint: after a resume the script draws a
different one, and every later step differs, silently.

Two tools:

* :func:`step_generator` — a ``torch.Generator`` seeded from ``(seed, step, rank)``: a batch drawn
  from it depends only on the step number, so it needs no saved state and is the same after any
  resume (``Run.rng(step)`` hands one out).
* :class:`BoundaryCheck` — fingerprints the global generators (torch CPU, the current CUDA device
  when initialised, Python's ``random``, NumPy's legacy global) at a boundary and warns, once per
  place, with a :class:`ResumeDivergenceWarning` when they moved before the point where the state is
  captured or the next step begins.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import warnings
from typing import Any, Collection, cast

import numpy as np
import torch


class ResumeDivergenceWarning(UserWarning):
    """State changed outside a step: a run resumed from a checkpoint will not match one that never stopped."""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_site(skip: int = 1) -> tuple[str, int, int]:
    """(file, line, level) of the innermost frame outside slurmft and contextlib, searched from
    ``skip`` frames above this function: the user's line that called into slurmft. ``level`` counts
    from the frame at ``skip`` (1), so ``warnings.warn``'s stacklevel from there is ``level + skip - 1``."""
    frame = sys._getframe(skip)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (os.path.abspath(name).startswith(_PACKAGE) or name.endswith(f"{os.sep}contextlib.py")):
            return name, frame.f_lineno, level
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return "<unknown>", 0, 1


def warn_user(message: str, site: tuple[str, int] | None = None) -> None:
    """A :class:`ResumeDivergenceWarning` attributed to ``site`` (the user's line that drew, when
    the draw tracer found it), else to the user's line that called into slurmft, whatever depth of
    slurmft calls it (``skip_file_prefixes`` is Python 3.12+)."""
    if site is not None:
        warnings.warn_explicit(message, ResumeDivergenceWarning, site[0], site[1])
        return
    _, _, level = user_site(2)  # level 1 = warn_user's caller
    warnings.warn(message, ResumeDivergenceWarning, stacklevel=level + 1)


def step_seed(seed: int, step: int, rank: int | None) -> int:
    """A 63-bit seed from ``(seed, step, rank)``; ``rank=None`` gives the same seed on every rank."""
    digest = hashlib.sha256(f"slurmft-step-rng:{seed}:{step}:{'all' if rank is None else rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def step_generator(seed: int, step: int, rank: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator on ``device`` seeded by :func:`step_seed` from ``seed``, the 1-based
    ``step`` and ``rank`` (None: the same stream on every rank). Batches drawn from it depend only
    on those numbers, so a resumed run draws what an uninterrupted one did with nothing to save;
    ``Run.rng(step)`` is this with the run's seed and rank."""
    gen = torch.Generator(device=device)
    gen.manual_seed(step_seed(seed, step, rank))
    return gen


def rng_fingerprint(only: Collection[str] | None = None) -> dict[str, Any]:
    """The global generators' states, comparable with ``==`` (copies; about 50 us for all, 2 us
    for torch's). ``only``: just these generators (``torch``, ``cuda``, ``python``, ``numpy``)."""
    def wanted(name: str) -> bool:
        return only is None or name in only

    prints: dict[str, Any] = {}
    if wanted("torch"):
        prints["torch"] = bytes(torch.get_rng_state().numpy())
    if wanted("python"):
        prints["python"] = random.getstate()
    if wanted("numpy"):
        # The stub also admits a dict (what legacy=True returns for a RandomState over another bit
        # generator); np.random's global RandomState is always MT19937, so this is the legacy tuple.
        legacy = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True))
        _name, keys, pos, has_gauss, gauss = legacy
        prints["numpy"] = (keys.tobytes(), pos, has_gauss, gauss)
    if wanted("cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        prints["cuda"] = bytes(torch.cuda.get_rng_state().numpy())
    return prints


def changed_generators(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the generators whose state differs (one only in ``after`` counts as unchanged)."""
    return [name for name in before if name in after and before[name] != after[name]]


class BoundaryCheck:
    """Remember the generators' state at a boundary; warn once per ``where`` if they moved since.

    rank: only rank 0 warns (default 0). enabled: False makes every call a no-op (default True).

    ``mark()`` at the boundary (after a restore, at the end of a step's work); ``check(where)``
    where nothing should have drawn since. Only rank 0 warns, with ``warnings.warn`` (stderr, the
    category filterable); every rank counts ``warnings``.
    """

    def __init__(self, *, rank: int = 0, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self._mark: dict[str, Any] | None = None
        self._warned: set[str] = set()
        # A held warning: (message, its advice, site, the generators that moved, their states then)
        self._held: tuple[str, str, tuple[str, int] | None, list[str], dict[str, Any]] | None = None
        self.warnings = 0

    def mark(self) -> None:
        if self.enabled:
            self._mark = rng_fingerprint()

    def clear(self) -> None:
        self._mark = None

    def check(self, where: str, advice: str, site: tuple[str, int] | None = None, *,
              hold: bool = False) -> list[str]:
        """Generators that moved since ``mark()`` (and warn about them once per ``where``, at
        ``site`` when the line that drew is known). ``hold``: keep the warning for :meth:`settle`."""
        if not self.enabled or self._mark is None:
            return []
        moved = changed_generators(self._mark, rng_fingerprint())
        if moved and where not in self._warned:
            self._warned.add(where)
            message = (f"slurmft: WARNING: {', '.join(moved)} random state advanced {where}: "
                       f"whatever was drawn there is in no checkpoint, so a resumed run will "
                       f"differ from one that never stopped.")
            if hold:
                self._held = (message, advice, site, moved, rng_fingerprint(moved))
            else:
                self._warn(f"{message} {advice}", site)
        return moved

    def settle(self, step: int) -> None:
        """After each step while a :meth:`check` is held: warn at the first step that draws from a
        generator that had moved (naming that step), and not before. A draw before the loop shifts
        a stream only the loop's own draws would see: an evaluation there, in a loop whose batches
        come from ``run.rng(step)`` or a sampler and whose model has no dropout, resumes bit for bit
        and is never warned about; a loop that draws from it only at step 8 is warned about there.
        The moved generators' states stay those of the loop's start until a step draws from them,
        so one comparison per step (only those generators: a few microseconds) suffices."""
        if self._held is None:
            return
        message, advice, site, moved, before = self._held
        if changed_generators(before, rng_fingerprint(moved)):
            self._held = None
            self._warn(f"{message} Step {step} is the first step that draws from it. {advice}", site)

    def drop(self) -> None:
        """Forget a held warning (a rollback restored the generators: the comparison is void)."""
        self._held = None

    def _warn(self, message: str, site: tuple[str, int] | None) -> None:
        self.warnings += 1
        if self.rank == 0:
            warn_user(message, site)
