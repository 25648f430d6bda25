"""A manifest from a newer slurmft is not damage: it is never skipped, listed as corrupt or pruned.

The checkpoints are real (CheckpointManager in one process, real DCP); only ``format_version`` of
one manifest is raised to a number this slurmft does not know.
"""

import json

import pytest
import torch

from slurmft.rundir import RunDir
from slurmft.checkpoint.manager import CheckpointConfig, CheckpointError, CheckpointManager
from slurmft.checkpoint.listing import list_checkpoints
from slurmft.checkpoint.manifest import (FORMAT_VERSION, MANIFEST_NAME, ManifestError, ManifestVersionError,
                                         read_manifest)
from slurmft.checkpoint.verify import verify_checkpoint
from slurmft.checkpoint.state import TrainState


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.fixture
def run(tmp_path):
    """Committed steps 1 and 2; step 2's manifest claims a newer format."""
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=5))
    state = _state()
    for step in (1, 2):
        manager.save(step, state, block=True)
    manager.close()
    path = RunDir(tmp_path).checkpoint(2) / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["format_version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(data))
    return tmp_path


def test_the_error_says_upgrade(run):
    path = RunDir(run).checkpoint(2)
    with pytest.raises(ManifestVersionError) as info:
        read_manifest(path)
    assert isinstance(info.value, ManifestError)
    assert (info.value.found, info.value.known) == (FORMAT_VERSION + 1, FORMAT_VERSION)
    assert str(info.value) == (f"{path / MANIFEST_NAME}: written by a newer slurmft (format "
                               f"{FORMAT_VERSION + 1}, this one reads up to {FORMAT_VERSION}): upgrade slurmft")


def test_verify_raises_instead_of_reporting_damage(run):
    with pytest.raises(ManifestVersionError):
        verify_checkpoint(RunDir(run).checkpoint(2))
    assert verify_checkpoint(RunDir(run).checkpoint(1)).ok


def test_listing_marks_it_newer_not_broken(run):
    infos = {i.step: i for i in list_checkpoints(run)}
    assert infos[2].newer_format and infos[2].manifest is None and "upgrade slurmft" in infos[2].error
    assert not infos[1].newer_format and infos[1].error is None


def test_load_latest_stops_instead_of_falling_back(run):
    manager = CheckpointManager(run, CheckpointConfig(keep_last=1))
    try:
        with pytest.raises(CheckpointError, match="upgrade slurmft"):  # -> NO_REQUEUE in a job
            manager.load_latest(_state())
    finally:
        manager.close()
    assert RunDir(run).committed_steps() == [1, 2]  # nothing skipped over, nothing deleted


def test_an_older_newer_format_checkpoint_does_not_stop_loading_the_newest(run):
    manager = CheckpointManager(run, CheckpointConfig(keep_last=5))
    state = _state()
    try:
        manager.save(3, state, block=True)
        assert manager.load_latest(_state()) == 3
    finally:
        manager.close()
    assert RunDir(run).committed_steps() == [1, 2, 3]
