"""The shard file writer: DCP's byte layout, hashed while written, readable by plain torch and DCP."""

from __future__ import annotations

import io
import os
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import WriteItemType

from slurmft.checkpoint import shard_writer
from slurmft.checkpoint.manifest import hash_file
from slurmft.checkpoint.shard_writer import ShardStream, save_tensor, write_shard_file
from slurmft.checkpoint.writer import CommitWriter


def test_save_tensor_is_torch_save_without_crc(tmp_path):
    tensor = torch.arange(10_000, dtype=torch.float32)
    ours, theirs = io.BytesIO(), io.BytesIO()
    save_tensor(tensor, ours)
    torch.save(tensor, theirs)
    assert len(ours.getvalue()) == len(theirs.getvalue())
    crcs = {i.filename.split("/", 1)[1]: i.CRC for i in zipfile.ZipFile(ours).infolist()}
    assert crcs["data/0"] == 0  # the tensor's bytes were not CRC'd...
    assert zipfile.ZipFile(theirs).getinfo(next(n for n in zipfile.ZipFile(theirs).namelist()
                                                if n.endswith("data/0"))).CRC != 0  # ...torch's were
    assert torch.equal(torch.load(io.BytesIO(ours.getvalue()), weights_only=True), tensor)


def test_stream_hash_matches_the_file_and_refuses_an_existing_file(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_writer, "WRITEBACK_BYTES", 1000)  # exercise early writeback too
    path = tmp_path / "f.bin"
    stream = ShardStream(path)
    payload = os.urandom(10_000)
    for start in range(0, len(payload), 777):
        stream.write(memoryview(payload)[start:start + 777])
    stream.sync()
    stream.close()
    assert path.read_bytes() == payload
    assert stream.tell() == len(payload)
    assert stream.hasher.hexdigest() == hash_file(path)
    with pytest.raises(FileExistsError):
        ShardStream(path)


def test_first_write_callback_runs_once(tmp_path):
    calls = []
    stream = ShardStream(tmp_path / "f.bin", lambda: calls.append(1))
    stream.write(b"a")
    stream.write(b"b")
    stream.close()
    assert calls == [1]


def test_checkpoint_round_trips_through_plain_dcp_and_a_view_saves_only_its_bytes(tmp_path):
    big = torch.arange(1_000_000, dtype=torch.float64)
    state = {"w": torch.randn(64, 64), "view": big[10:20], "n": 7, "blob": {"k": "v"}}
    writer = CommitWriter(tmp_path / "step_000000001", "t1", 1, 1)
    dcp.save(state, storage_writer=writer, no_dist=True)
    target = {"w": torch.zeros(64, 64), "view": torch.zeros(10, dtype=torch.float64), "n": 0,
              "blob": {"k": ""}}
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "step_000000001"), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["view"], big[10:20])
    assert target["n"] == 7 and target["blob"] == {"k": "v"}
    shard = tmp_path / "step_000000001" / "__0_0.distcp"
    assert shard.stat().st_size < 64 * 64 * 4 + 100_000  # not the 8 MB storage behind the view
    assert writer.bytes_written == shard.stat().st_size


def test_write_shard_file_offsets_cover_the_file(tmp_path):
    class Planner:
        def __init__(self, items):
            self.items = items

        def resolve_data(self, item):
            return self.items[item.index.fqn]

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

    data = {"a": io.BytesIO(b"hello"), "b": torch.ones(3), "c": torch.zeros(5, dtype=torch.int64)}
    items = [WriteItem(index=MetadataIndex("a"), type=WriteItemType.BYTE_IO),
             WriteItem(index=MetadataIndex("b"), type=WriteItemType.TENSOR),
             WriteItem(index=MetadataIndex("c"), type=WriteItemType.TENSOR)]
    out = write_shard_file(tmp_path / "s.distcp", "s.distcp", items, Planner(data))
    raw = (tmp_path / "s.distcp").read_bytes()
    spans = sorted((r.storage_data.offset, r.storage_data.length) for r in out.results)
    assert spans[0] == (0, 5) and raw[:5] == b"hello"
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] == len(raw) == out.entry.size
    by_fqn = {r.index.fqn: r.storage_data for r in out.results}
    info = by_fqn["c"]
    loaded = torch.load(io.BytesIO(raw[info.offset:info.offset + info.length]), weights_only=True)
    assert torch.equal(loaded, data["c"])
    assert out.entry.hash == hash_file(tmp_path / "s.distcp")
