"""Every private torch API has a public path, and a checkpoint still round-trips on it.

``SLURMFT_TORCH_PUBLIC_ONLY=1`` (read once, when ``slurmft.checkpoint.torch_compat`` is imported) forces
every public path; each check runs in a fresh interpreter so the choice is really made at import.
The multi-rank FSDP2 round trip on the public paths is in test_checkpoint_dist.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from slurmft.checkpoint import torch_compat

ROUND_TRIP = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed.checkpoint as dcp
    from slurmft.checkpoint import torch_compat
    from slurmft.checkpoint.manager import CheckpointManager
    from slurmft.checkpoint.verify import verify_checkpoint
    from slurmft.rundir import RunDir
    from slurmft.checkpoint.state import TrainState

    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        return TrainState(model, opt)

    run = sys.argv[1]
    state = make(0)
    manager = CheckpointManager(run)
    manager.save(1, state, block=True)
    manager.save(2, state, block=True)  # the second save refills the same staging buffers
    fresh = make(1)
    loaded = CheckpointManager(run).load_latest(fresh)
    same = all(torch.equal(a, b) for a, b in zip(state.model.state_dict().values(),
                                                fresh.model.state_dict().values()))
    plain = {k: torch.zeros_like(v) for k, v in state.model.state_dict().items()}
    dcp.load({"model": plain}, checkpoint_id=str(RunDir(run).checkpoint(2)), no_dist=True)
    plain_same = all(torch.equal(plain[k], v) for k, v in state.model.state_dict().items())
    print(json.dumps({"paths": torch_compat.private_paths(), "loaded": loaded, "same": same,
                      "plain_dcp_same": plain_same,
                      "verified": verify_checkpoint(RunDir(run).checkpoint(2)).ok}))
""")


def _round_trip(tmp_path, public_only: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(torch_compat.PUBLIC_ONLY_ENV, None)
    if public_only:
        env[torch_compat.PUBLIC_ONLY_ENV] = "1"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", ROUND_TRIP, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("public_only", [True, False], ids=["public-paths", "private-paths"])
def test_a_checkpoint_round_trips_on_either_path(tmp_path, public_only):
    result = _round_trip(tmp_path, public_only)
    assert set(result["paths"].values()) == {not public_only}  # every path switched, none left over
    assert result["loaded"] == 2 and result["same"] and result["verified"]
    assert result["plain_dcp_same"]  # still plain DCP that dcp.load reads without slurmft


def test_set_element_builds_nested_containers_like_dcp():
    root: dict = {}
    torch_compat.set_element(root, ("train", "sched", 2), 5)
    torch_compat.set_element(root, ("train", "name"), "x")
    assert root == {"train": {"sched": [None, None, 5], "name": "x"}}


def test_public_copy_fills_the_destination_buffers():
    src = {"a": torch.arange(3.0), "b": [torch.ones(2), 7], "c": "text"}
    dst = {"a": torch.zeros(3), "b": [torch.zeros(2), 0], "c": ""}
    out = torch_compat._copy_public(src, dst, non_blocking=False)
    assert out["a"] is dst["a"] and torch.equal(dst["a"], src["a"])
    assert torch.equal(dst["b"][0], torch.ones(2)) and out["b"][1] == 7 and out["c"] == "text"
