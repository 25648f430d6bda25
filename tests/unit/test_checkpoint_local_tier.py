"""The node-local tier in one process, real DCP: saves commit on the local disk first and reach the
run directory every ``shared_interval`` steps; loading takes the newest step either tier holds and
falls back past a damaged one; where the tier lives, the record of what it holds, and bad settings.
(Several ranks on several nodes, a node lost, a kill during the copy: test_checkpoint_dist.py.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from slurmft.cli import app
from slurmft.config import ConfigError
from slurmft.rundir import RunDir, atomic_write_json
from slurmft.checkpoint.manager import CheckpointConfig, CheckpointError, CheckpointManager
from slurmft.checkpoint.local_tier import NodeMap, copy_verified
from slurmft.checkpoint.manifest import FileEntry
from slurmft.checkpoint.verify import verify_checkpoint
from slurmft.checkpoint.state import TrainState
from slurmft.checkpoint.tiers import local_checkpoints, read_tier_index, write_tier_index


def make_state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    return TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_step(state: TrainState, seed: int) -> None:
    torch.manual_seed(seed)
    state.model(torch.randn(4, 16)).pow(2).mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()


def params(state: TrainState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


@pytest.fixture
def node(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "n01")
    return "n01"


def tiered(tmp_path: Path, **kw) -> CheckpointConfig:
    return CheckpointConfig(**{"keep_last": 10, "local_dir": str(tmp_path / "nvme" / "{node}"),
                               "shared_interval": 2, "keep_local": 2, **kw})


def saved(tmp_path: Path, steps: tuple[int, ...], **kw) -> tuple[RunDir, TrainState, CheckpointManager]:
    """A manager with the local tier that trained and saved (non-blocking) each of ``steps``."""
    run = RunDir(tmp_path / "run")
    state = make_state()
    manager = CheckpointManager(run.root, tiered(tmp_path, **kw))
    for step in steps:
        train_step(state, step)
        manager.save(step, state)
        manager.wait()
    return run, state, manager


def test_saves_commit_locally_and_reach_the_run_dir_every_shared_interval(tmp_path, node):
    run = RunDir(tmp_path / "run")
    state = make_state()
    manager = CheckpointManager(run.root, tiered(tmp_path))
    kept = {}
    for step in (1, 2, 3, 4):
        train_step(state, step)
        kept[step] = params(state)
        manager.save(step, state)
        manager.wait()
    stats = manager.stats
    manager.close()
    assert [(s.step, s.tier, s.committed) for s in stats] == [
        (1, "shared", True), (2, "local", True), (3, "shared", True), (4, "local", True)]
    assert all(s.local_s is not None and s.local_s <= s.total_s for s in stats)
    assert run.committed_steps() == [1, 3]
    local = local_checkpoints(str(tmp_path / "nvme" / "{node}"), run.root, node)
    assert local.parent.parent == tmp_path / "nvme" / node
    assert sorted(p.name for p in local.iterdir()) == ["step_000000003", "step_000000004"]  # keep_local
    assert read_tier_index(run) == {node: (3, 4)}
    for ckpt in (run.checkpoint(1), run.checkpoint(3), local / "step_000000003", local / "step_000000004"):
        assert verify_checkpoint(ckpt).ok  # one node: its local copy is whole

    # A login node sees the local tier through the job's record only.
    listed = CliRunner().invoke(app, ["ckpt", "ls", "--json", str(run.root)])
    assert listed.exit_code == 0, listed.output
    shown = json.loads(listed.stdout)
    assert [(c["step"], c["local_nodes"]) for c in shown["checkpoints"]] == [(1, []), (3, [node])]
    assert shown["local_only"] == [{"step": 4, "local_nodes": [node]}]
    table = CliRunner().invoke(app, ["ckpt", "ls", str(run.root)], env={"COLUMNS": "250"})
    assert "run dir + local (n01)" in table.stdout and "local only" in table.stdout

    # The newest step is only on the local disk: it is the one loaded.
    fresh = make_state()
    loader = CheckpointManager(run.root, tiered(tmp_path))
    assert loader.load_latest(fresh) == 4
    assert loader.loaded_tier == "local"  # restart_phases' tier
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), kept[4]))
    loader.close()

    # A damaged local shard is skipped like any bad checksum: step 3, from the local disk or
    # the run dir, is next.
    shard = local / "step_000000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    # Step 3's local copy is damaged too: its copy in the run dir is read instead.
    shard = local / "step_000000003" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    fresh = make_state()
    loader = CheckpointManager(run.root, tiered(tmp_path))
    assert loader.load_latest(fresh) == 3
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), kept[3]))
    loader.close()


def test_a_lost_local_disk_leaves_the_run_dir(tmp_path, node):
    run, state, manager = saved(tmp_path, (1,), shared_interval=100)
    train_step(state, 2)
    manager.save(2, state, block=True)  # a blocking save is always copied
    manager.close()
    assert run.committed_steps() == [1, 2]
    shutil.rmtree(tmp_path / "nvme")  # the node is gone, or the job came back elsewhere
    fresh = make_state()
    loader = CheckpointManager(run.root, tiered(tmp_path))
    assert loader.load_latest(fresh) == 2
    assert loader.loaded_tier == "shared"
    loader.close()


def test_node_map_sends_each_nodes_shards_to_the_next_node():
    assert NodeMap(("a", "a", "b")).replica_pairs() == [(0, 2), (1, 2), (2, 0)]
    assert NodeMap(("a", "b", "c")).replica_pairs() == [(0, 1), (1, 2), (2, 0)]
    assert NodeMap(("a", "a")).replica_pairs() == []  # one node: nowhere to replicate
    layout = NodeMap(("b", "a", "b", "a"))
    assert layout.order == ["b", "a"] and [layout.leader(r) for r in range(4)] == [True, True, False, False]


def test_local_checkpoints_are_per_node_and_per_run(tmp_path):
    a = local_checkpoints("/nvme/{node}/ckpt", tmp_path / "run1", "n01")
    b = local_checkpoints("/nvme/{node}/ckpt", tmp_path / "run2", "n01")
    assert a.parts[:4] == ("/", "nvme", "n01", "ckpt") and a.name == "checkpoints"
    assert a != b and a.parent.name.startswith("run1-")
    for bad in ("", "..", "a/b", "n 1"):
        with pytest.raises(ValueError, match="cannot be part of a path"):
            local_checkpoints("/nvme/{node}", tmp_path, bad)


def test_tier_record_round_trips_and_refuses_hostile_files(tmp_path):
    run = RunDir(tmp_path)
    assert read_tier_index(run) == {}
    write_tier_index(run, {"n02": [5, 3], "n01": [5]})
    assert read_tier_index(run) == {"n01": (5,), "n02": (3, 5)}
    for bad in ({"format": 1, "nodes": {"../x": [1]}}, {"format": 1, "nodes": {"n1": ["1"]}},
                {"format": 1, "nodes": {"n1": [-1]}}, {"format": 9, "nodes": {}}, ["x"]):
        atomic_write_json(run.ckpt_tiers, bad)
        with pytest.raises(ValueError, match="ckpt_tiers.json"):
            read_tier_index(run)
    run.ckpt_tiers.unlink()
    os.symlink("/etc/passwd", run.ckpt_tiers)
    with pytest.raises(ValueError, match="symbolic link"):
        read_tier_index(run)
    run.checkpoints.mkdir()
    listed = CliRunner().invoke(app, ["ckpt", "ls", str(run.root)])  # a bad record only warns
    assert listed.exit_code == 0 and "node-local tiers not shown" in listed.stderr


def test_copy_to_the_run_dir_refuses_a_file_that_does_not_match_its_manifest(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "__0_0.distcp").write_bytes(b"x" * 100)
    problems = copy_verified(src, dst, FileEntry("__0_0.distcp", 100, "0" * 32))
    assert len(problems) == 1 and "does not match the manifest" in problems[0]
    os.symlink(src / "__0_0.distcp", src / "link.distcp")
    problems = copy_verified(src, dst, FileEntry("link.distcp", 100, "0" * 32))
    assert len(problems) == 1 and "link" in problems[0]


@pytest.mark.parametrize("env, message", [
    ({"SLURMFT_CHECKPOINT_LOCAL_DIR": "nvme/ckpt"}, "[checkpoint] local_dir must be an absolute path"),
    ({"SLURMFT_CHECKPOINT_LOCAL_DIR": "/nvme", "SLURMFT_CHECKPOINT_INCREMENTAL": "true"},
     "cannot be combined with incremental"),
    ({"SLURMFT_CHECKPOINT_SHARED_INTERVAL": "0"}, "[checkpoint] shared_interval must be >= 1, got 0"),
    ({"SLURMFT_CHECKPOINT_KEEP_LOCAL": "0"}, "[checkpoint] keep_local must be >= 1, got 0"),
    ({"SLURMFT_CHECKPOINT_LOCAL_DIRR": "/nvme"}, "has no key 'local_dirr'"),
])
def test_bad_local_tier_settings_name_the_key(env, message):
    with pytest.raises(ConfigError) as err:
        CheckpointConfig.load(environ=env)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_local_metadata_that_differs_from_the_manifest_is_not_trusted(tmp_path, node, caplog):
    run, _state, manager = saved(tmp_path, (1, 2), shared_interval=100)
    manager.close()
    assert run.committed_steps() == [1]
    metadata = local_checkpoints(str(tmp_path / "nvme" / "{node}"), run.root, node) / "step_000000002" / ".metadata"
    data = metadata.read_bytes()
    at = data.index(b"weight")  # still a valid pickle, naming a tensor that does not exist
    metadata.write_bytes(data[:at] + b"Weight" + data[at + 6:])
    fresh = make_state()
    loader = CheckpointManager(run.root, tiered(tmp_path))
    with caplog.at_level(logging.WARNING, logger="slurmft.checkpoint.manager"):
        assert loader.load_latest(fresh) == 1
    loader.close()
    assert ".metadata: does not match the manifest" in caplog.text


def test_a_blocking_save_whose_copy_to_the_run_dir_fails_raises(tmp_path, node, monkeypatch):
    import slurmft.checkpoint.local_tier as local_tier

    real_copy = local_tier.copy_verified

    def rot_then_copy(src_dir, dst_dir, entry):  # the local disk returns other bytes than written
        path = src_dir / entry.path
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        return real_copy(src_dir, dst_dir, entry)

    run = RunDir(tmp_path / "run")
    state = make_state()
    manager = CheckpointManager(run.root, tiered(tmp_path))
    monkeypatch.setattr(local_tier, "copy_verified", rot_then_copy)
    with pytest.raises(CheckpointError, match="node-local tier only"):
        manager.save(1, state, block=True)
    manager.close()
    assert run.committed_steps() == []  # nothing half-copied was committed
    assert manager.stats[-1].tier == "local"


def test_an_emergency_save_of_a_step_committed_only_locally_copies_it(tmp_path, node):
    # step 2: the periodic save of the step the job then ends at, on the local tier only
    run, state, manager = saved(tmp_path, (1, 2), shared_interval=100)
    assert run.committed_steps() == [1]
    stats = manager.emergency_save(2, state)  # preempted at step 2: it must reach the run dir
    manager.close()
    assert stats is not None and (stats.step, stats.tier) == (2, "shared")
    assert run.committed_steps() == [1, 2] and verify_checkpoint(run.checkpoint(2)).ok
