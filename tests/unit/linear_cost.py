"""Linear cost of a reader of untrusted input, against a baseline measured in the same test.

The baseline is the same reader over the same kind of input at 1/8 of the cap (as many entries as
fit in an eighth); at the cap a linear reader costs at most 8 times that (fixed costs make it
less), a quadratic one 64 times. ``assert_linear`` allows ``factor`` (3) times the linear
extrapolation, so the bound is proportional to the input's size, holds on a loaded machine (both
runs slow down together; each is the best of a few), and no wall-clock budget is asserted.

The reader at the cap runs in a forked child, so a quadratic one is stopped at the bound, with a
message naming it, instead of running for minutes.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Callable

import pytest

SCALE = 8  # the baseline's input is 1/SCALE of the cap


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timings of ``fn()``, in seconds (noise only adds time)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _child(fn: Callable[[], object], repeat: int, conn) -> None:  # runs in the fork
    conn.send(best_of(fn, repeat))


def assert_linear(what: str, reader_for: Callable[[int], Callable[[], object]], *,
                  factor: float = 3.0, repeat: int = 1) -> tuple[float, float]:
    """``reader_for(d)`` writes an input of 1/d of the cap (d = 1: at the cap) and returns the
    reader over it. Fails unless the reader at the cap takes at most ``factor`` x ``SCALE`` x
    its time at 1/``SCALE``. Returns (seconds at the cap, seconds at 1/SCALE)."""
    small = reader_for(SCALE)
    small()  # warm: imports, first-call caches
    base = best_of(small, 3)
    at_cap = reader_for(1)
    bound = factor * SCALE * base
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(at_cap, repeat, child))
    proc.start()
    child.close()
    if not parent.poll(bound * repeat + 10):  # every repeat, and the fork's own start
        proc.kill()
        proc.join()
        pytest.fail(f"{what}: not done within {bound * repeat + 10:.1f} s, while the same reader "
                    f"over 1/{SCALE} of it took {base:.3f} s (killed)")
    took = parent.recv()
    proc.join()
    assert took <= bound, (f"{what}: {took:.3f} s at the cap, more than {factor:g} x {SCALE} x "
                           f"its {base:.3f} s over 1/{SCALE} of it: not linear")
    return took, base
