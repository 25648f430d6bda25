"""The staging buffers' structure check (``staging._signature``), run in every save's blocking
part: it tells a changed state (buffers allocated again) from the same one, and its cost is linear
in the state dict's entries (a real model's optimizer state has thousands of them; it was built by
concatenating tuples, quadratic)."""

from __future__ import annotations

import torch

from linear_cost import assert_linear
from slurmft.checkpoint.staging import Stager, _signature

CAP = 48_000  # tensors in the state dict at the cap


def _state(tensors: int) -> dict:
    return {"model": {f"layers.{i}.weight": torch.zeros(2) for i in range(tensors // 2)},
            "optim": {"state": {f"layers.{i}.weight": {"exp_avg": torch.zeros(2), "step": 3}
                                for i in range(tensors // 2)},
                      "param_groups": [{"lr": 0.1, "params": [f"layers.{i}.weight"
                                                              for i in range(tensors // 2)]}]}}


def test_the_structure_check_is_linear_in_the_states_entries():
    def reader_for(d):
        state = _state(CAP // d)
        return lambda: _signature(state)

    took, base = assert_linear("the staging buffers' structure check", reader_for)
    print(f"_signature: {took:.3f} s at {CAP} tensors, {base:.4f} s at 1/16")


def test_the_structure_names_every_entry_in_order():
    state = {"b": [torch.zeros(2, 3, dtype=torch.float16), 7], "a": (torch.zeros(1), "x"), 3: {}}
    assert _signature(state) == (
        ("", "dict", 3),
        ("/3", "dict", 0),                   # keys sorted by str(): "3" < "a" < "b"
        ("/a", "tuple", 2), ("/a/0", "tensor", torch.float32, (1,), "cpu"), ("/a/1", "value"),
        ("/b", "list", 2), ("/b/0", "tensor", torch.float16, (2, 3), "cpu"), ("/b/1", "value"))


def test_buffers_are_allocated_again_only_when_the_structure_changes():
    stager = Stager()
    state = _state(8)
    stager.stage(state)
    pointers = stager.buffer_pointers()
    state["optim"]["state"]["layers.0.weight"]["exp_avg"].add_(1.0)   # values change: same buffers
    stager.stage(state)
    assert stager.allocations == 1 and stager.buffer_pointers() == pointers
    state["optim"]["state"]["layers.0.weight"]["exp_avg_sq"] = torch.zeros(2)  # a new entry
    staged = stager.stage(state)
    assert stager.allocations == 2
    assert torch.equal(staged["optim"]["state"]["layers.0.weight"]["exp_avg"], torch.ones(2))
    state["model"]["layers.0.weight"] = torch.zeros(3)                 # a new shape
    stager.stage(state)
    assert stager.allocations == 3
