"""The allow-list unpickler for DCP's ``.metadata`` (slurmft/checkpoint/dcp_metadata.py), on a real
checkpoint written by CheckpointManager and on hand-made pickles the opcode scan lets through."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from slurmft.rundir import RunDir
from slurmft.checkpoint.dcp_metadata import MetadataRefused, SafeMetadataReader, load_dcp_metadata, parse_dcp_metadata
from slurmft.checkpoint.manifest import DCP_METADATA_NAME
from slurmft.checkpoint.pickle_scan import metadata_pickle_problem

import hostile

pytestmark = pytest.mark.timeout(120)
CLASS_STATE = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"  # the class itself
               b"N}U\x06__eq__N" b"s\x86b.")  # BUILD (None, {"__eq__": None}) on it


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return RunDir(hostile.make_pristine(tmp_path_factory.mktemp("run"))).checkpoint(3)


def test_a_real_metadata_loads(ckpt):
    metadata = load_dcp_metadata(ckpt)
    assert isinstance(metadata, Metadata) and metadata.state_dict_metadata
    assert SafeMetadataReader(str(ckpt)).read_metadata().storage_meta.load_id is not None


def test_state_set_on_an_allowed_class_is_refused():
    assert metadata_pickle_problem(CLASS_STATE, "m") is None  # only allowed globals: the scan passes
    with pytest.raises(MetadataRefused, match="refused to set state on the type Metadata"):
        parse_dcp_metadata(CLASS_STATE, "m")
    assert Metadata.__eq__ is not None


@pytest.mark.parametrize("data, message", [
    (pickle.dumps({"a": 1}), "holds a dict, not DCP metadata"),
    (b"\x80\x04garbage", "not a DCP metadata pickle"),
    (pickle.dumps(print), "refused to unpickle builtins.print"),
])
def test_anything_else_is_refused_naming_the_file(data, message):
    with pytest.raises(MetadataRefused, match=message) as info:
        parse_dcp_metadata(data, "run/checkpoints/step_000000003/.metadata")
    assert str(info.value).startswith("run/checkpoints/step_000000003/.metadata: ")


def test_dcp_load_through_the_reader_never_unpickles_freely(ckpt, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    marker = tmp_path / "PWNED"
    # A copy: the module's checkpoint is shared, and in a random order a later test read this
    # hostile .metadata as the real one.
    ckpt = Path(shutil.copytree(ckpt, tmp_path / ckpt.name))
    (ckpt / DCP_METADATA_NAME).write_bytes(pickle.dumps(hostile.Payload(marker)))
    with pytest.raises(CheckpointException) as info:  # DCP wraps what the reader raised
        dcp.load({}, storage_reader=SafeMetadataReader(str(ckpt)), no_dist=True)
    failures = info.value.failures
    assert any("refused to unpickle posix.system" in str(e) for e, _tb in failures.values())
    assert not marker.exists()


def test_a_restore_unpickles_the_metadata_once(ckpt, tmp_path, monkeypatch):
    """The coordinator checks ``.metadata`` through the allow-list before the load, and DCP's load
    reads it again through the reader: the reader takes the checked one (each parse ~0.1 s on the
    critical path of every restart)."""
    import torch

    import slurmft.checkpoint.dcp_metadata as dcp_metadata
    from slurmft.checkpoint.manager import CheckpointConfig, CheckpointManager

    run = tmp_path / "run"
    shutil.copytree(ckpt.parent.parent, run, symlinks=True)
    parsed: list[str] = []
    real = dcp_metadata.parse_dcp_metadata
    monkeypatch.setattr(dcp_metadata, "parse_dcp_metadata",
                        lambda data, shown: parsed.append(str(shown)) or real(data, shown))
    state = hostile.make_model_state()
    manager = CheckpointManager(run, CheckpointConfig(keep_last=10), job_id="8", restart_count=1)
    try:
        assert manager.load_latest(state) == 3
    finally:
        manager.close()
    assert parsed == [str(RunDir(run).checkpoint(3) / DCP_METADATA_NAME)]
    assert all(torch.isfinite(p).all() for p in state.model.parameters())
