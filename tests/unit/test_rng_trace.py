"""The draw tracer names the user's exact line that moved a global generator (or the sampler),
with the user's calls above it; a model's own forward draws are not the user's; it is bounded and
leaves an installed tracer (a debugger, coverage) alone."""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

from slurmft.train.rng_trace import DrawTracer, is_user_file
from slurmft.train.sampler import ResumableSampler


def _line_of(text: str) -> int:
    """The line of this file that holds ``text`` (so the test does not pin line numbers)."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)


def draw_a_batch():
    x = torch.randn(4, 3)  # DRAW-SITE
    return x * 2


def test_a_draw_in_a_helper_is_named_at_its_line_with_the_callers_line():
    tracer = DrawTracer().start()
    a = 1
    batch = draw_a_batch()  # CALL-SITE
    b = a + 1
    draws = tracer.stop()
    assert batch.shape == (4, 3) and b == 2
    assert len(draws) == 1, draws
    (draw,) = draws
    assert (draw.moved, draw.file, draw.line, draw.function) == (
        ("torch",), __file__, _line_of("# DRAW-SITE"), "draw_a_batch")
    assert draw.callers[0] == (__file__, _line_of("# CALL-SITE")), draw.callers
    assert draw.describe().startswith(f"{__file__}:{_line_of('# DRAW-SITE')} (torch, in draw_a_batch(), "
                                      f"called from {__file__}:{_line_of('# CALL-SITE')}")


def test_every_global_generator_and_the_sampler_are_told_apart():
    sampler = ResumableSampler(10, 2, rank=0, world_size=1, seed=1)
    it = iter(sampler)
    tracer = DrawTracer(sampler=sampler).start()
    random.random()  # PY
    np.random.rand(3)  # NP
    next(it)  # SAMPLER
    _ = 1
    draws = tracer.stop()
    assert [(d.moved, d.line) for d in draws] == [
        (("python",), _line_of("# PY")), (("numpy",), _line_of("# NP")),
        (("sampler",), _line_of("# SAMPLER"))], draws


def test_a_models_own_forward_draws_are_excluded_and_the_lines_after_it_marked():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5))
    tracer = DrawTracer()
    remove = tracer.forward_hooks(model)
    tracer.start()
    x = torch.ones(2, 3)
    model(x)  # dropout draws here, by design: in the checkpoint's RNG state
    nxt = draw_a_batch()  # the next step's batch, prefetched after the forward
    draws = tracer.stop()
    remove()
    assert nxt is not None
    assert [(d.line, d.in_forward_step) for d in draws] == [(_line_of("# DRAW-SITE"), True)], draws


def test_it_stops_at_its_bound_and_says_so():
    tracer = DrawTracer(max_checks=20).start()
    total = 0
    for i in range(100):
        total += i
    tracer.stop()
    assert total == 4950
    assert tracer.truncated and not tracer.active
    assert sys.gettrace() is None


def test_an_installed_tracer_is_left_alone():
    def other(frame, event, arg):
        return None

    sys.settrace(other)
    try:
        tracer = DrawTracer().start()
        torch.rand(1)
        assert tracer.stop() == [] and not tracer.available
        assert sys.gettrace() is other
    finally:
        sys.settrace(None)


def test_user_files_are_the_users_own():
    assert is_user_file(__file__)
    assert not is_user_file(torch.__file__)
    assert not is_user_file(random.__file__)
    assert not is_user_file(sys.modules["slurmft.train.rng_trace"].__file__)
    assert not is_user_file("<string>")


def test_each_cause_is_explained_by_the_lines_the_next_step_drew_at():
    from slurmft.train.resume_audit import explain_step
    from slurmft.train.resume_check import Divergence
    from slurmft.train.rng_trace import Draw

    before = Draw(("torch",), "/u/train.py", 10, "get_batch", (("/u/train.py", 50),), False)
    after = Draw(("torch",), "/u/train.py", 11, "get_batch", (("/u/train.py", 60),), True)
    smp = Draw(("sampler",), "/u/train.py", 12, "main", (), False)

    def why(cause, draws):
        return explain_step(Divergence(4, cause, "m"), 5, draws)

    # the held batch: the draw after the forward pass is the one named (the prefetch), first
    text, draw = why("stale_inputs", [before, after])
    assert draw is after and text.index("/u/train.py:11") < text.index("/u/train.py:10"), text
    assert "called from /u/train.py:60" in text and "Draw each step's batch inside the step" in text
    # no line of the user's drew: the batch comes from state not carried (a loader's iterator)
    text, draw = why("inputs", [])
    assert draw is None and "Run(sampler=...)" in text, text
    # the sampler moved: its line; the RNG drew differently: the lines that draw
    assert why("sampler", [before, smp])[1] is smp
    assert why("rng", [before, after])[1] is before
    assert why("loss", [])[1] is None
