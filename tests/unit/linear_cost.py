"""Linear cost of a reader of untrusted input, against a baseline measured in the same test.

The baseline is the same reader over the same kind of input at 1/16 of the cap (as many entries
as fit in a sixteenth); at the cap a linear reader costs at most 16 times that (fixed costs make
it less), a quadratic one 256 times. ``assert_linear`` allows ``factor`` (4) times the linear
extrapolation, so the bound is proportional to the input's size, holds on a loaded machine (each
is the CPU time of the best of a few: waiting for a core is not counted), and no wall-clock
budget is asserted.

The reader at the cap runs in a forked child, so a quadratic one is stopped at the bound, with a
message naming it, instead of running for minutes.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Callable

import pytest

SCALE = 16  # the baseline's input is 1/SCALE of the cap
# Scheduling noise on a loaded 2-core machine, allowed on top: a 64 KiB file reads in ~1 ms at
# 1/16, where one preemption is more than the linear bound; a quadratic reader is seconds over.
NOISE_S = 0.25


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timings of ``fn()``, in CPU seconds of this process: a loaded
    machine makes the reader wait for a core, which wall time counted (seen: the sweep state's
    reader at its cap took 3.1 s of wall time beside a full test run, 1.9 s allowed), and a
    quadratic reader's extra work is CPU all the same."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def _child(fn: Callable[[], object], repeat: int, conn) -> None:  # runs in the fork
    try:
        fn()  # warm: first-call caches, and the fork's copy-on-write of what the reader touches
        conn.send(best_of(fn, repeat))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        conn.send(f"{type(exc).__name__}: {exc}")


def _in_fork(fn: Callable[[], object], repeat: int, wait_s: float | None) -> float | None:
    """``best_of(fn, repeat)`` in a forked child (both sizes pay the same fork costs); None when
    it was not done within ``wait_s`` (it is killed then)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, repeat, child))
    proc.start()
    child.close()
    try:
        if not parent.poll(wait_s):
            return None
        got = parent.recv()
        if isinstance(got, str):
            pytest.fail(f"the reader failed: {got}")
        return float(got)
    finally:
        proc.kill()
        proc.join()


def assert_linear(what: str, reader_for: Callable[[int], Callable[[], object]], *,
                  factor: float = 4.0, repeat: int = 2) -> tuple[float, float]:
    """``reader_for(d)`` writes an input of 1/d of the cap (d = 1: at the cap) and returns the
    reader over it. Fails unless the reader at the cap (best of ``repeat``) takes at most
    ``factor`` x ``SCALE`` x its time at 1/``SCALE`` (best of 3). Returns both times."""
    base = _in_fork(reader_for(SCALE), 3, None)
    assert base is not None
    bound = factor * SCALE * base + NOISE_S
    # A liveness bound in wall time over a CPU-time bound: on a loaded machine the child waits for
    # a core (two busy processes beside a whole suite: both readers at the cap failed a 3x wait
    # while linear). A quadratic reader still fails: either here or on the CPU-time assert below.
    wait = 10 * bound * (repeat + 1) + 60  # the warm-up, every repeat, and the fork's own start
    took = _in_fork(reader_for(1), repeat, wait)
    if took is None:
        pytest.fail(f"{what}: not done within {wait:.1f} s, while the same reader over 1/{SCALE} "
                    f"of it took {base:.3f} s (killed)")
    assert took <= bound, (f"{what}: {took:.3f} s at the cap, more than {factor:g} x {SCALE} x "
                           f"its {base:.4f} s over 1/{SCALE} of it (+ {NOISE_S} s): not linear")
    return took, base
