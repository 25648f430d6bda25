"""Incremental saves in one process, real DCP: a fine-tuning state (most weights frozen) writes only
what changed, references the rest, and every reader follows the references (the verifying loader,
``ckpt verify``, plain ``dcp.load``, DCP's consolidation to one torch.save file, the safetensors
export); retention keeps what a kept checkpoint references.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from typer.testing import CliRunner

from slurmft.cli import app
from slurmft.rundir import RunDir
from slurmft.checkpoint.manager import CheckpointConfig, CheckpointError, CheckpointManager
from slurmft.checkpoint.manifest import Manifest, ManifestError, read_manifest
from slurmft.checkpoint.verify import verify_checkpoint
from slurmft.checkpoint.retention import RetentionPolicy, plan_prune
from slurmft.checkpoint.state import TrainState


def make_state(seed: int = 0) -> TrainState:
    """A 'fine-tuning' state: a large frozen base (embedding + linear) and a small trained head."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 256), torch.nn.Linear(256, 256),
                                torch.nn.Linear(256, 4))
    for layer in model[:2]:
        layer.requires_grad_(False)
    return TrainState(model, torch.optim.AdamW(model[2].parameters(), lr=1e-2))


def train_step(state: TrainState, seed: int) -> None:
    torch.manual_seed(seed)
    state.model(torch.randint(0, 512, (8,))).pow(2).mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()


def snapshot(state: TrainState) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in state.model.state_dict().items()}
    for p, s in state.optimizer.state_dict()["state"].items():
        out.update({f"optim.{p}.{k}": v.clone() for k, v in s.items()})
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def incremental(**kw) -> CheckpointConfig:
    return CheckpointConfig(**{"keep_last": 10, "incremental": True, "full_every": 100, **kw})


@pytest.fixture
def three_saves(tmp_path):
    """Steps 1 (whole), 2 and 3 (incremental; step 3 with one frozen weight changed by hand)."""
    state = make_state()
    manager = CheckpointManager(tmp_path, incremental())
    states = {}
    for step in (1, 2, 3):
        train_step(state, step)
        if step == 3:
            manager.fence()
            with torch.no_grad():
                state.model[1].bias.add_(1.0)  # a "frozen" tensor that did change: written again
        manager.save(step, state, block=True)
        states[step] = snapshot(state)
    manager.close()
    return tmp_path, states, manager.stats


def test_a_save_writes_only_what_changed_and_loads_back_bit_for_bit(three_saves):
    root, states, stats = three_saves
    run = RunDir(root)
    whole, second, third = stats
    assert whole.bytes_reused == 0 and second.bytes_reused > 0
    # The frozen base is ~98 % of the bytes: an incremental save writes a small fraction of them.
    assert second.bytes_written < 0.1 * whole.bytes_written, (second.bytes_written, whole.bytes_written)
    assert third.bytes_written > second.bytes_written  # the changed "frozen" bias went in again
    m1, m2, m3 = (read_manifest(run.checkpoint(s)) for s in (1, 2, 3))
    assert (m1.format_version, m1.refs) == (1, ())
    assert m2.format_version == 2 and m2.referenced_steps == {1} and m3.referenced_steps == {1}
    shards = {f"../step_000000001/{f.path}" for f in m1.files if f.path.endswith(".distcp")}
    assert {r.path for r in m2.refs} == shards
    for step in (1, 2, 3):
        report = verify_checkpoint(run.checkpoint(step))
        assert report.ok, report.problems
    assert verify_checkpoint(run.checkpoint(2)).bytes_checked == m2.total_bytes + sum(
        f.size for f in m1.files if f.path.endswith(".distcp"))

    fresh = make_state(seed=99)
    manager = CheckpointManager(root, incremental())
    assert manager.load_latest(fresh) == 3
    assert_same(snapshot(fresh), states[3])
    train_step(fresh, 4)
    manager.save(4, fresh, block=True)  # a process's first save is whole: nothing remembered
    manager.close()
    assert manager.stats[-1].bytes_reused == 0 and read_manifest(run.checkpoint(4)).refs == ()


def test_plain_dcp_readers_follow_the_references(three_saves, tmp_path_factory):
    root, states, _ = three_saves
    step_dir = RunDir(root).checkpoint(3)
    template = {"model": make_state(seed=7).model.state_dict()}
    dcp.load(template, checkpoint_id=step_dir)  # DCP's own FileSystemReader, no slurmft
    for key, value in template["model"].items():
        assert torch.equal(value, states[3][f"model.{key}"]), key
    out = tmp_path_factory.mktemp("consolidated") / "step3.pt"
    dcp_to_torch_save(step_dir, out)  # DCP's consolidation into one torch.save file
    consolidated = torch.load(out, weights_only=True)
    for key, value in consolidated["model"].items():
        assert torch.equal(value, states[3][f"model.{key}"]), key


def test_export_and_verify_follow_the_references_and_a_damaged_base_fails_them(three_saves, tmp_path_factory):
    from safetensors.torch import load_file

    root, states, _ = three_saves
    runner = CliRunner()
    out = tmp_path_factory.mktemp("export") / "model.safetensors"
    result = runner.invoke(app, ["ckpt", "export", str(root), "3", str(out)])
    assert result.exit_code == 0, result.output
    for key, value in load_file(out).items():
        assert torch.equal(value, states[3][f"model.{key}"]), key
    result = runner.invoke(app, ["ckpt", "verify", str(root), "3"])
    assert result.exit_code == 0, result.output
    assert "+ 1 referenced in step(s) 1" in result.output
    listed = json.loads(runner.invoke(app, ["ckpt", "ls", str(root), "--json"]).output)
    assert [c["references"] for c in listed["checkpoints"]] == [[], [1], [1]]

    base = RunDir(root).checkpoint(1) / "__0_0.distcp"
    data = bytearray(base.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the frozen embedding's record
    base.write_bytes(bytes(data))
    result = runner.invoke(app, ["ckpt", "verify", str(root), "3"])
    assert result.exit_code == 1
    assert f"{base}: wrong checksum" in result.output and "(referenced)" in result.output
    fresh = make_state(seed=99)
    before = fresh.model.state_dict()
    before = {k: v.clone() for k, v in before.items()}
    manager = CheckpointManager(root, incremental())
    assert manager.load_latest(fresh) is None  # 3 and 2 reference the damaged file, 1 holds it
    manager.close()
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_retention_keeps_what_a_kept_checkpoint_references(tmp_path):
    state = make_state()
    manager = CheckpointManager(tmp_path, incremental(keep_last=1, full_every=3))
    kept = []
    for step in (1, 2, 3, 4):
        train_step(state, step)
        manager.save(step, state, block=True)
        kept.append(RunDir(tmp_path).committed_steps())
    manager.close()
    # 2 and 3 reference 1, so 1 stays while either is kept; 4 is whole (every third save).
    assert kept == [[1], [1, 2], [1, 3], [4]]


def test_ckpt_prune_keeps_referenced_checkpoints(three_saves):
    root, _, _ = three_saves
    result = CliRunner().invoke(app, ["ckpt", "prune", str(root), "--keep-last", "1"])
    assert result.exit_code == 0, result.output
    assert RunDir(root).committed_steps() == [1, 3]


def test_plan_prune_keeps_references_and_everything_older_when_they_are_unknown():
    policy = RetentionPolicy(keep_last=1)
    f = frozenset
    assert plan_prune([1, 2, 3], 3, [], policy, {3: f({1}), 2: f({1})}).keep_steps == (1, 3)
    assert plan_prune([1, 2, 3, 4], 4, [], policy, {4: None}).keep_steps == (1, 2, 3, 4)
    assert plan_prune([1, 2, 3, 4], 4, [], policy, {3: None}).keep_steps == (4,)  # 3 goes anyway
    assert plan_prune([1, 2], 2, [], policy, {2: f({0})}).keep_steps == (2,)  # long gone
    # Transitively: a kept checkpoint's references stay loadable too.
    assert plan_prune([1, 2, 3], 3, [], policy, {2: f({1}), 3: f({2})}).keep_steps == (1, 2, 3)
    assert plan_prune([1, 2, 3], 3, [], policy, {2: None, 3: f({2})}).keep_steps == (1, 2, 3)
    # The newest whole checkpoint older than every referenced one is the shared files' fallback.
    refs = {2: f({1}), 5: f({4}), 6: f({4})}
    assert plan_prune([1, 2, 4, 5, 6], 6, [], policy, refs).keep_steps == (1, 4, 6)
    assert plan_prune([1, 2, 4, 5, 6], 6, [], RetentionPolicy(keep_last=3), refs).keep_steps == (1, 4, 5, 6)


def _step_changing(state: TrainState, manager: CheckpointManager, step: int, *frozen: torch.Tensor) -> None:
    """A training step (head, Adam, every RNG) that also changes the given frozen tensors."""
    random.gauss(0, 1)  # once: its cached second value changes too
    np.random.standard_normal()
    train_step(state, step)
    manager.fence()
    with torch.no_grad():
        for tensor in frozen:
            tensor.add_(1.0)


def test_a_chain_of_references_is_kept_whole_and_loadable(tmp_path):
    state = make_state()
    model = state.model
    manager = CheckpointManager(tmp_path, incremental(keep_last=1))
    _step_changing(state, manager, 1)
    manager.save(1, state, block=True)
    _step_changing(state, manager, 2, model[1].weight, model[1].bias)
    manager.save(2, state, block=True)  # references the embedding in step 1
    _step_changing(state, manager, 3, model[0].weight)
    manager.save(3, state, block=True)  # references the linear layer in step 2
    manager.close()
    run = RunDir(tmp_path)
    assert [read_manifest(run.checkpoint(s)).referenced_steps for s in (2, 3)] == [{1}, {2}]
    assert run.committed_steps() == [1, 2, 3]
    assert all(verify_checkpoint(run.checkpoint(s)).ok for s in (1, 2, 3))


def test_a_step_that_a_newer_checkpoint_references_is_never_replaced(tmp_path):
    state = make_state()
    manager = CheckpointManager(tmp_path, incremental())
    manager.save(1, state, block=True)
    train_step(state, 2)
    manager.save(2, state, block=True)
    train_step(state, 3)
    with pytest.raises(CheckpointError, match=r"step_000000001 is already committed and step\(s\) 2 "
                                              r"reference its files"):
        manager.save(1, state, block=True)  # e.g. replayed after a rollback
    manager.close()
    run = RunDir(tmp_path)
    assert all(verify_checkpoint(run.checkpoint(s)).ok for s in (1, 2))


def test_a_referenced_file_touched_since_it_was_written_is_not_referenced_again(tmp_path):
    state = make_state()
    manager = CheckpointManager(tmp_path, incremental())
    manager.save(1, state, block=True)
    os.utime(RunDir(tmp_path).checkpoint(1) / "__0_0.distcp")  # rewritten in place, as far as a stat tells
    train_step(state, 2)
    manager.save(2, state, block=True)
    train_step(state, 3)
    manager.save(3, state, block=True)
    manager.close()
    assert [s.bytes_reused > 0 for s in manager.stats] == [False, False, True]
    assert read_manifest(RunDir(tmp_path).checkpoint(3)).referenced_steps == {2}


def _manifest_json(**changes):
    data = {"format_version": 2, "step": 5, "world_size": 1, "torch_version": "2.13.0", "job_id": None,
            "restart_count": None, "created_at": 0.0, "hash_algo": "xxh3_128", "extra": {},
            "files": [{"path": ".metadata", "size": 1, "hash": "00"}],
            "refs": [{"path": "../step_000000003/__0_0.distcp", "size": 1, "hash": "00"}]}
    data.update(changes)
    return data


@pytest.mark.parametrize("refs, message", [
    ([{"path": "../step_000000005/__0_0.distcp", "size": 1, "hash": "0"}], "older step_N"),
    ([{"path": "../step_000000009/__0_0.distcp", "size": 1, "hash": "0"}], "older step_N"),
    ([{"path": "../../etc/passwd", "size": 1, "hash": "0"}], "older step_N"),
    ([{"path": "../step_000000003/../../x", "size": 1, "hash": "0"}], "older step_N"),
    ([{"path": "step_000000003/__0_0.distcp", "size": 1, "hash": "0"}], "older step_N"),
    ([{"path": "../step_3/__0_0.distcp", "size": 1, "hash": "0"}], "older step_N"),
])
def test_a_reference_must_name_a_file_of_an_older_checkpoint(refs, message):
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(_manifest_json(refs=refs))


def test_references_need_format_2():
    assert Manifest.from_json(_manifest_json()).referenced_steps == {3}
    with pytest.raises(ManifestError, match="'refs' needs format_version 2"):
        Manifest.from_json(_manifest_json(format_version=1))


def test_without_the_private_writer_api_every_save_is_whole(tmp_path, monkeypatch, caplog):
    from slurmft.checkpoint import torch_compat

    monkeypatch.setattr(torch_compat, "FAST_SHARD_WRITE", False)  # as with SLURMFT_TORCH_PUBLIC_ONLY=1
    state = make_state()
    manager = CheckpointManager(tmp_path, incremental())
    for step in (1, 2):
        train_step(state, step)
        manager.save(step, state, block=True)
    manager.close()
    assert [s.bytes_reused for s in manager.stats] == [0, 0]
    assert read_manifest(RunDir(tmp_path).checkpoint(2)).refs == ()
    assert "every save is written whole" in caplog.text


def test_references_of_a_checkpoint_that_can_never_load_are_none_but_a_newer_format_keeps_all(three_saves):
    from slurmft.safeio import open_dir
    from slurmft.checkpoint.retention import read_references

    root, _, _ = three_saves
    run = RunDir(root)
    (run.checkpoint(2) / "manifest.json").write_text("{not json")
    data = json.loads((run.checkpoint(3) / "manifest.json").read_text())
    data["format_version"] = 99
    (run.checkpoint(3) / "manifest.json").write_text(json.dumps(data))
    fd = open_dir(run.checkpoints)
    try:
        assert read_references(fd, [1, 2, 3, 7]) == {1: frozenset(), 2: frozenset(), 3: None}
    finally:
        os.close(fd)
