"""CheckpointManager in one process (no process group): round trips, corruption, staging, retention."""

import json
import logging
import os
import pickle
import random
import threading
import time

import numpy as np
import pytest
import torch

from slurmft.config import ConfigError
from slurmft.rundir import RunDir
from slurmft.checkpoint.manager import CheckpointConfig, CheckpointError, CheckpointManager
from slurmft.checkpoint.listing import list_checkpoints
from slurmft.checkpoint.manifest import DCP_METADATA_NAME, MANIFEST_NAME
from slurmft.checkpoint.verify import verify_checkpoint
from slurmft.checkpoint.state import TrainState
from slurmft.train.watchdog import StepWatchdog
from slurmft.checkpoint.writer import CommitWriter


class CountingSampler:
    """Stands in for the resumable sampler: a plain global offset."""

    def __init__(self) -> None:
        self.offset = 0

    def state_dict(self):
        return {"offset": self.offset}

    def load_state_dict(self, sd):
        self.offset = sd["offset"]


def make_state(seed=0, width=16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return TrainState(model, opt, sched, CountingSampler(), extras={"tokens_seen": 0})


def train_step(state):
    x = torch.randn(4, 8)
    loss = state.model(x).pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.scheduler.step()
    state.sampler.offset += 4
    state.extras["tokens_seen"] += 32


def snapshot(state):
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


def assert_same_model(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_round_trip_restores_everything(tmp_path):
    state = make_state()
    manager = CheckpointManager(tmp_path)
    for step in range(1, 4):
        train_step(state)
        manager.save(step, state)
    manager.wait()
    saved_model = snapshot(state)
    saved_optim = state.optimizer.state_dict()
    draws_after_save = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    fresh = make_state(seed=123)
    assert manager.load_latest(fresh) == 3
    # The restored generators replay exactly what followed the save.
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws_after_save
    assert_same_model(saved_model, snapshot(fresh))
    for pid, pstate in saved_optim["state"].items():
        for key, value in pstate.items():
            assert torch.equal(value, fresh.optimizer.state_dict()["state"][pid][key]), key
    assert fresh.scheduler.state_dict() == state.scheduler.state_dict()
    assert fresh.sampler.offset == 12 and fresh.extras == {"tokens_seen": 96} and fresh.step == 3


def test_checkpoint_is_plain_dcp(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(5, state, block=True)
    ckpt = RunDir(tmp_path).checkpoint(5)
    assert sorted(os.listdir(ckpt)) == [DCP_METADATA_NAME, "__0_0.distcp", MANIFEST_NAME]
    assert verify_checkpoint(ckpt).ok
    with open(ckpt / DCP_METADATA_NAME, "rb") as fh:
        metadata = pickle.load(fh)
    assert not any("slurmft" in str(key) for key in metadata.storage_data)
    assert str(metadata.storage_meta.checkpoint_id) == str(ckpt)
    dcp_to_torch_save(ckpt, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert torch.equal(full["model"]["0.weight"], state.model[0].weight)
    assert full["train"]["step"] == 5


def _flip(path, offset=100):
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped_shard_byte": lambda c: _flip(c / "__0_0.distcp", 5000),
    "truncated_shard": lambda c: os.truncate(c / "__0_0.distcp", 1000),
    "deleted_metadata": lambda c: (c / DCP_METADATA_NAME).unlink(),
    "corrupt_manifest": lambda c: (c / MANIFEST_NAME).write_text('{"format_version": 1, "step": '),
    "manifest_claims_other_size": lambda c: (c / MANIFEST_NAME).write_text(
        json.dumps({**json.loads((c / MANIFEST_NAME).read_text()),
                    "files": [{**f, "size": f["size"] + 1} for f in json.loads((c / MANIFEST_NAME).read_text())["files"]]})),
}


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_corrupt_newest_is_skipped_and_previous_loaded(tmp_path, damage, caplog):
    state = make_state()
    manager = CheckpointManager(tmp_path)
    train_step(state)
    manager.save(1, state, block=True)
    at_step_1 = snapshot(state)
    train_step(state)
    manager.save(2, state, block=True)
    CORRUPTIONS[damage](RunDir(tmp_path).checkpoint(2))

    fresh = make_state(seed=99)
    with caplog.at_level(logging.WARNING, logger="slurmft.checkpoint.manager"):
        assert manager.load_latest(fresh) == 1
    assert any("checkpoint step 2 skipped" in r.getMessage() for r in caplog.records)
    assert_same_model(at_step_1, snapshot(fresh))
    assert fresh.sampler.offset == 4


def test_nothing_valid_is_a_fresh_start(tmp_path, caplog):
    state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, block=True)
    (RunDir(tmp_path).checkpoint(1) / DCP_METADATA_NAME).unlink()
    before = snapshot(state)
    with caplog.at_level(logging.INFO, logger="slurmft.checkpoint.manager"):
        assert manager.load_latest(state) is None
        assert CheckpointManager(tmp_path / "empty").load_latest(state) is None
    assert sum("fresh start" in r.getMessage() for r in caplog.records) == 2
    assert_same_model(before, snapshot(state))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.timeout(60)
def test_staging_buffers_are_reused(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainState(model, optimizer)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # ~25 MB
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=1))
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    manager.save(1, state, block=True)
    pointers = manager.staging_pointers()
    rss_after_first = _rss_bytes()
    for step in range(2, 12):
        manager.fence()  # the weights change outside optimizer.step()
        with torch.no_grad():
            model[0].weight.add_(1.0)
        manager.save(step, state)
    manager.wait()
    assert manager.staging_allocations == 1
    assert manager.staging_pointers() == pointers and len(pointers) >= 8
    # Ten more saves of ~25 MB each: resident memory stays within a quarter of one copy.
    assert _rss_bytes() - rss_after_first < state_bytes // 4
    assert [s.step for s in manager.stats] == list(range(1, 12))
    assert all(s.committed and s.blocking_s <= s.total_s and s.bytes_written > state_bytes for s in manager.stats)
    fresh = TrainState(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)))
    fresh.optimizer = torch.optim.AdamW(fresh.model.parameters())
    assert manager.load_latest(fresh) == 11
    assert torch.equal(fresh.model[0].weight, model[0].weight)


def test_retention_and_on_commit(tmp_path):
    seen = []
    config = CheckpointConfig(keep_last=2, milestones=(2,))
    manager = CheckpointManager(tmp_path, config, job_id="77", restart_count=3,
                                on_commit=lambda step, path, stats: seen.append((step, path, stats.step)))
    state = make_state()
    abandoned = RunDir(tmp_path).checkpoints / "step_000000003.tmp-deadbeef"
    abandoned.mkdir(parents=True)
    for step in range(1, 7):
        manager.save(step, state)
    manager.wait()
    infos = list_checkpoints(tmp_path)
    assert [(i.step, i.committed) for i in infos] == [(2, True), (5, True), (6, True)]
    assert seen == [(s, RunDir(tmp_path).checkpoint(s), s) for s in range(1, 7)]
    assert infos[-1].manifest.job_id == "77" and infos[-1].manifest.restart_count == 3


def test_busy_skip_and_emergency_save(tmp_path, monkeypatch):
    gate = threading.Event()
    real_finish = CommitWriter.finish

    def gated_finish(self, metadata, results):
        gate.wait(30)
        real_finish(self, metadata, results)

    monkeypatch.setattr(CommitWriter, "finish", gated_finish)
    state = make_state()
    manager = CheckpointManager(tmp_path, CheckpointConfig(on_busy="skip"))
    assert manager.save(1, state) is True
    assert manager.save(2, state) is False and manager.skipped == 1
    assert RunDir(tmp_path).committed_steps() == []
    threading.Timer(0.3, gate.set).start()
    stats = manager.emergency_save(3, state)  # waits for step 1, then commits step 3
    assert stats.step == 3 and stats.committed
    assert RunDir(tmp_path).committed_steps() == [1, 3]
    assert manager.emergency_save(3, state) is None  # already committed: nothing to do


def test_resave_of_committed_step_replaces_it(tmp_path):
    state = make_state()
    CheckpointManager(tmp_path).save(4, state, block=True)
    train_step(state)
    manager = CheckpointManager(tmp_path)  # a new job (e.g. after a rollback) saves step 4 again
    manager.save(4, state, block=True)
    infos = list_checkpoints(tmp_path)
    assert [(i.step, i.committed) for i in infos] == [(4, True)]
    fresh = make_state(seed=5)
    assert manager.load_latest(fresh) == 4
    assert_same_model(snapshot(state), snapshot(fresh))


def test_failed_blocking_save_raises(tmp_path, monkeypatch):
    def broken_finish(self, metadata, results):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CommitWriter, "finish", broken_finish)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint step 1 failed: .*No space left on device"):
        manager.save(1, make_state(), block=True)
    assert not manager.stats[-1].committed
    assert RunDir(tmp_path).committed_steps() == []


def test_non_json_extras_are_rejected(tmp_path):
    state = make_state()
    state.extras["bad"] = object()
    with pytest.raises(TypeError, match="extras state must be plain JSON data"):
        CheckpointManager(tmp_path).save(1, state)


def test_config_from_toml_and_errors(tmp_path):
    toml = tmp_path / "slurmft.toml"
    toml.write_text("[checkpoint]\ninterval = 50\nkeep_last = 2\nmilestones = [1000, 2000]\non_busy = 'skip'\n")
    config = CheckpointConfig.load(toml)
    assert (config.interval, config.keep_last, config.milestones, config.on_busy) == (50, 2, (1000, 2000), "skip")
    assert config.retention().milestones == frozenset({1000, 2000})
    with pytest.raises(ConfigError, match=r"\[checkpoint\] keep_last must be an integer >= 1"):
        CheckpointConfig.load(toml, keep_last=0)
    with pytest.raises(ConfigError, match=r"\[checkpoint\] on_busy must be one of 'wait', 'skip'"):
        CheckpointConfig.load(toml, on_busy="drop")
    with pytest.raises(ConfigError, match=r"\[checkpoint\] unknown key 'intervall'"):
        CheckpointConfig.load(toml, intervall=3)


def test_generator_state_missing_from_checkpoint_is_not_requested(tmp_path, monkeypatch):
    import slurmft.checkpoint.state as state_module

    state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, block=True)
    real_capture = state_module.capture_rng_state
    # The loading job has a generator the saving job had not (CUDA initialised only now).
    monkeypatch.setattr(state_module, "capture_rng_state",
                        lambda: {**real_capture(), "cuda": torch.zeros(16, dtype=torch.uint8)})
    assert manager.load_latest(make_state(seed=3)) == 1


def test_fault_plan_rejects_unknown_phase(monkeypatch):
    from slurmft.checkpoint.writer import FAULT_ENV, FaultPlan

    monkeypatch.setenv(FAULT_ENV, "renamed@12")
    assert FaultPlan.from_env().pause_phase == "renamed" and FaultPlan.from_env().pause_step == 12
    monkeypatch.setenv(FAULT_ENV, "halfway")
    with pytest.raises(ValueError, match="unknown phase 'halfway'"):
        FaultPlan.from_env()


def test_commit_refuses_ranks_that_wrote_another_checkpoint(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from slurmft.checkpoint.writer import _FILES_FQN

    writer = CommitWriter(RunDir(tmp_path).checkpoint(7), "abc", 7, 2)
    other = RunDir(tmp_path).checkpoints / "step_000000006.tmp-xyz"
    carrier = WriteResult(index=MetadataIndex(_FILES_FQN), size_in_bytes=0, storage_data=(str(other), (), ()))
    ours = WriteResult(index=MetadataIndex(_FILES_FQN), size_in_bytes=0, storage_data=(str(writer.path), (), ()))
    with pytest.raises(RuntimeError, match="rank 1 wrote .*step_000000006.tmp-xyz, coordinator wrote"):
        writer.finish(Metadata(state_dict_metadata={}), [[ours], [carrier]])
    assert RunDir(tmp_path).committed_steps() == []


def test_a_manager_that_is_dropped_is_not_kept_alive_by_its_idle_save_thread(tmp_path):
    import gc
    import weakref

    manager = CheckpointManager(tmp_path, CheckpointConfig())
    manager.save(1, TrainState(torch.nn.Linear(2, 2)), block=True)
    ref = weakref.ref(manager)
    del manager
    gc.collect()
    assert ref() is None


@pytest.mark.timeout(60)
def test_every_wait_for_a_stuck_save_is_bounded_and_names_it(tmp_path, monkeypatch):
    gate = threading.Event()
    real_finish = CommitWriter.finish

    def stuck_finish(self, metadata, results):
        gate.wait(60)  # a commit that never ends (a dead peer, a hung filesystem)
        real_finish(self, metadata, results)

    monkeypatch.setattr(CommitWriter, "finish", stuck_finish)
    state = make_state()
    manager = CheckpointManager(tmp_path, CheckpointConfig(save_timeout_s=0.3, exit_timeout_s=0.3))
    try:
        assert manager.save(1, state) is True
        with pytest.raises(CheckpointError, match=r"checkpoint save of step 1 still in flight after waiting 0.3 s"):
            manager.wait()
        with pytest.raises(CheckpointError, match="checkpoint save of step 1 still in flight"):
            manager.save(2, state)
        with pytest.raises(CheckpointError, match="checkpoint save of step 1 still in flight"):
            manager.emergency_save(2, state)
        t0 = time.monotonic()
        manager.close()  # gives up on the stuck save after exit_timeout_s instead of waiting for it
        assert time.monotonic() - t0 < 5
    finally:
        gate.set()


def test_saves_and_loads_are_phases_of_the_step_watchdog(tmp_path, monkeypatch):
    seen = []
    real_finish = CommitWriter.finish

    def spying_finish(self, metadata, results):
        seen.append(dog.watching)
        real_finish(self, metadata, results)

    monkeypatch.setattr(CommitWriter, "finish", spying_finish)
    dog = StepWatchdog(timeout_s=60)
    manager = CheckpointManager(tmp_path, watchdog=dog)
    state = make_state()
    dog.step_started(3)
    manager.emergency_save(3, state)
    assert seen == ["checkpoint save of step 3"]
    assert dog.watching == "step 3"  # the phase ended; the step goes on
    dog.step_finished()
    real_load = manager._load
    monkeypatch.setattr(manager, "_load", lambda *a, **kw: (seen.append(dog.watching), real_load(*a, **kw))[1])
    assert manager.load_latest(make_state()) == 3
    assert seen[-1] == "checkpoint load"
    manager.close()


def test_a_restart_reads_the_checkpoint_once_verifying_as_it_loads(tmp_path, monkeypatch):
    import slurmft.checkpoint.loading as checkpoint_module
    import slurmft.checkpoint.verify as verify_module
    from slurmft.checkpoint.manifest import read_manifest
    from slurmft.checkpoint.verified_read import VerifyingReader

    state = make_state()
    train_step(state)
    CheckpointManager(tmp_path).save(1, state, block=True)
    readers = []

    class Recording(VerifyingReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            readers.append(self)

    def no_second_pass(paths, *args, **kwargs):
        if paths:
            raise AssertionError(f"hashed in a pass of its own before loading: {paths}")
        return []

    monkeypatch.setattr(checkpoint_module, "VerifyingReader", Recording)
    monkeypatch.setattr(verify_module, "hash_files", no_second_pass)
    fresh = make_state(seed=3)
    assert CheckpointManager(tmp_path).load_latest(fresh) == 1
    assert_same_model(snapshot(state), snapshot(fresh))
    total = read_manifest(RunDir(tmp_path).checkpoint(1)).total_bytes
    assert [r.bytes_read for r in readers] == [total]  # every byte once, shards and .metadata


def test_a_corrupt_only_checkpoint_leaves_the_state_untouched(tmp_path):
    state = make_state()
    train_step(state)
    CheckpointManager(tmp_path).save(1, state, block=True)
    _flip(RunDir(tmp_path).checkpoint(1) / "__0_0.distcp", 5000)
    fresh = make_state(seed=3)
    before = snapshot(fresh)
    assert CheckpointManager(tmp_path).load_latest(fresh) is None  # a fresh start...
    assert_same_model(before, snapshot(fresh))  # ...from the untouched initial state
    assert fresh.sampler.offset == 0
