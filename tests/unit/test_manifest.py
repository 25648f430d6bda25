"""Manifest format, checksums, verify and listing (torch-free)."""

import json
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest

from slurmft.rundir import RunDir, step_dirname
from slurmft.safeio import UnsafeFileError
from slurmft.checkpoint.listing import list_checkpoints
from slurmft.checkpoint.manifest import (DCP_METADATA_NAME, FORMAT_VERSION, MANIFEST_NAME, FileEntry,
                                         ManifestError, StreamHasher, build_manifest, hash_file,
                                         parse_tmp_dirname, read_manifest, tmp_dirname, write_manifest)
from slurmft.checkpoint.checksum import hash_files
from slurmft.checkpoint.verify import verify_checkpoint


def make_checkpoint(ckpt_dir, step, files=None):
    """A checkpoint dir with the given files (name -> bytes), a .metadata, and a manifest."""
    files = dict(files or {"__0_0.distcp": b"a" * 1000, "__1_0.distcp": os.urandom(3000)})
    files.setdefault(DCP_METADATA_NAME, pickle.dumps({"stands in for": "DCP metadata"}))  # names no global
    ckpt_dir.mkdir(parents=True)
    entries = []
    for name, data in files.items():
        (ckpt_dir / name).write_bytes(data)
        entries.append(FileEntry(name, len(data), hash_file(ckpt_dir / name)))
    manifest = build_manifest(step, 2, "2.13.0", entries, job_id="42", restart_count=1, extra={"k": [1]})
    write_manifest(ckpt_dir, manifest)
    return manifest


def test_manifest_round_trip(tmp_path):
    written = make_checkpoint(tmp_path / step_dirname(7), 7)
    read = read_manifest(tmp_path / step_dirname(7))
    assert read == written
    assert read.format_version == 1  # no refs: readable by every slurmft
    assert [f.path for f in read.files] == sorted(f.path for f in read.files)
    assert read.total_bytes == sum(f.size for f in read.files)


def test_streaming_hash_matches_file_hash(tmp_path):
    data = os.urandom(5 << 20)
    path = tmp_path / "blob"
    path.write_bytes(data)
    hasher = StreamHasher()
    for i in range(0, len(data), 777_777):
        hasher.update(memoryview(data)[i:i + 777_777])
    assert hasher.size == len(data)
    assert hasher.hexdigest() == hash_file(path) == hash_file(path, chunk=4096)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert hash_file(path) != hasher.hexdigest()


def test_manifest_module_does_not_import_torch():
    code = "import sys, slurmft.checkpoint.manifest, slurmft.checkpoint.retention; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format_version=FORMAT_VERSION + 1),
         f"written by a newer slurmft (format {FORMAT_VERSION + 1}, this one reads up to {FORMAT_VERSION}): "
         "upgrade slurmft"),
        (lambda d: d.pop("step"), "missing field 'step'"),
        (lambda d: d.update(world_size="2"), "field 'world_size' has the wrong type"),
        (lambda d: d.update(step=True), "field 'step' has the wrong type"),
        (lambda d: d["files"][0].update(path="../escape"), "must be relative, inside the checkpoint"),
        (lambda d: d["files"][0].update(size=-1), "size must be >= 0"),
        (lambda d: d.update(hash_algo="md5"), "unknown hash_algo 'md5'"),
        (lambda d: d.update(files="x"), "field 'files' has the wrong type"),
    ],
)
def test_malformed_manifest_names_the_problem(tmp_path, mutate, message):
    ckpt = tmp_path / step_dirname(1)
    make_checkpoint(ckpt, 1)
    data = json.loads((ckpt / MANIFEST_NAME).read_text())
    mutate(data)
    (ckpt / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=str(ckpt / MANIFEST_NAME)) as info:
        read_manifest(ckpt)
    assert message in str(info.value)


def test_missing_and_unparseable_manifest(tmp_path):
    with pytest.raises(ManifestError, match="manifest.json: missing"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_bytes(b'{"format_version": 1, "ste')
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_bytes(b"[1, 2]")
    with pytest.raises(ManifestError, match="expected a JSON object"):
        read_manifest(tmp_path)


def test_verify_ok_reports_progress(tmp_path):
    ckpt = tmp_path / step_dirname(3)
    manifest = make_checkpoint(ckpt, 3)
    seen = []
    report = verify_checkpoint(ckpt, progress=lambda done, total: seen.append((done, total)))
    assert report.ok, report.problems
    assert report.manifest == manifest
    assert report.bytes_checked == manifest.total_bytes
    assert seen[-1] == (manifest.total_bytes, manifest.total_bytes)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda c: _flip_byte(c / "__1_0.distcp", 1500), "__1_0.distcp: wrong checksum"),
        (lambda c: _flip_byte(c / DCP_METADATA_NAME, 0), ".metadata: wrong checksum"),
        (lambda c: (c / "__0_0.distcp").write_bytes(b"a" * 999), "__0_0.distcp: wrong size 999, manifest says 1000"),
        (lambda c: (c / DCP_METADATA_NAME).unlink(), ".metadata: DCP metadata missing"),
        (lambda c: (c / "__1_0.distcp").unlink(), "__1_0.distcp: file missing"),
        (lambda c: (c / "stray.bin").write_bytes(b"x"), "stray.bin: extra file, not listed"),
        (lambda c: (c / MANIFEST_NAME).write_bytes(b"\x00garbage"), "manifest.json: not valid JSON"),
        (lambda c: (c / MANIFEST_NAME).unlink(), "manifest.json: missing"),
    ],
)
def test_verify_detects_damage_naming_the_file(tmp_path, damage, expected):
    ckpt = tmp_path / step_dirname(3)
    make_checkpoint(ckpt, 3)
    damage(ckpt)
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert any(expected in p for p in report.problems), report.problems


def test_verify_rejects_manifest_of_another_step_and_unlisted_metadata(tmp_path):
    make_checkpoint(tmp_path / "src", 5)
    moved = tmp_path / step_dirname(6)
    os.rename(tmp_path / "src", moved)
    assert any("manifest says step 5, directory name says 6" in p for p in verify_checkpoint(moved).problems)

    ckpt = tmp_path / step_dirname(8)
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"z")
    write_manifest(ckpt, build_manifest(8, 1, "2.13.0", [FileEntry("__0_0.distcp", 1, hash_file(ckpt / "__0_0.distcp"))]))
    problems = verify_checkpoint(ckpt).problems
    assert problems == (f"{ckpt / DCP_METADATA_NAME}: not listed in the manifest",)


def test_tmp_dirnames():
    name = tmp_dirname(1300, "a1b2-c3")
    assert name == "step_000001300.tmp-a1b2-c3"
    assert parse_tmp_dirname(name) == 1300
    assert parse_tmp_dirname(step_dirname(1300)) is None
    assert parse_tmp_dirname("step_xx.tmp-a") is None
    assert parse_tmp_dirname("step_000000001.tmp-") is None
    with pytest.raises(ValueError, match="tmp id"):
        tmp_dirname(1, "../x")


def test_list_checkpoints(tmp_path):
    run = RunDir(tmp_path)
    assert list_checkpoints(tmp_path) == []
    m10 = make_checkpoint(run.checkpoint(10), 10)
    make_checkpoint(run.checkpoint(20), 20)
    (run.checkpoint(20) / MANIFEST_NAME).write_text("{")
    (run.checkpoints / tmp_dirname(30, "abc")).mkdir()
    (run.checkpoints / tmp_dirname(30, "abc") / "__0_0.distcp").write_bytes(b"12345")
    (run.checkpoints / "not-a-checkpoint").mkdir()
    (run.checkpoints / "stray-file").write_bytes(b"")

    infos = list_checkpoints(tmp_path)
    assert [(i.step, i.committed) for i in infos] == [(10, True), (20, True), (30, False)]
    ok, broken, tmp = infos
    assert ok.manifest == m10 and ok.error is None
    assert ok.size_bytes == m10.total_bytes + (run.checkpoint(10) / MANIFEST_NAME).stat().st_size
    assert broken.manifest is None and "not valid JSON" in broken.error
    assert tmp.manifest is None and tmp.error is None and tmp.size_bytes == 5
    assert tmp.name == tmp_dirname(30, "abc")


def test_verify_parts_share_the_checksums(tmp_path):
    ckpt = tmp_path / step_dirname(4)
    files = {f"__{i}_0.distcp": os.urandom(1000 * (i + 1)) for i in range(5)}
    manifest = make_checkpoint(ckpt, 4, files)
    _flip_byte(ckpt / "__3_0.distcp", 10)
    reports = [verify_checkpoint(ckpt, part=(i, 3)) for i in range(3)]
    assert sum(r.bytes_checked for r in reports) == manifest.total_bytes
    flagged = [r for r in reports if any("__3_0.distcp: wrong checksum" in p for p in r.problems)]
    assert len(flagged) == 1  # exactly one part hashed that file
    (ckpt / "__0_0.distcp").unlink()  # presence is checked by every part
    assert all(any("__0_0.distcp: file missing" in p for p in verify_checkpoint(ckpt, part=(i, 3)).problems)
               for i in range(3))
    with pytest.raises(ValueError, match="part must be"):
        verify_checkpoint(ckpt, part=(3, 3))


# ----------------------------------------------------------------------------- parallel hashing


def test_hash_files_matches_hash_file_and_reports_unreadable(tmp_path):
    paths = []
    for i, size in enumerate([0, 1, 5 << 20, 3 << 20, 17]):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(os.urandom(size))
    paths.append(tmp_path / "missing")
    paths.append(tmp_path)  # a directory: unreadable as a file
    got = hash_files(paths, threads=3)
    assert got[:5] == [hash_file(p) for p in paths[:5]]
    assert isinstance(got[5], FileNotFoundError)
    assert isinstance(got[6], UnsafeFileError) and "a directory" in str(got[6])  # never read as a file
    assert hash_files([]) == []
    with pytest.raises(ValueError, match="threads must be >= 1"):
        hash_files(paths, threads=0)


def test_verify_in_parallel_reports_like_one_thread_on_the_callers_thread(tmp_path):
    ckpt = tmp_path / step_dirname(4)
    files = {f"__{i}_0.distcp": os.urandom((i + 1) * (1 << 20) + i) for i in range(6)}
    make_checkpoint(ckpt, 4, files)
    _flip_byte(ckpt / "__4_0.distcp", 7)
    _flip_byte(ckpt / "__1_0.distcp", 7)
    (ckpt / "__2_0.distcp").unlink()
    (ckpt / "__0_0.distcp").write_bytes(b"short")
    caller = threading.get_ident()
    seen = []

    def progress(done, total):
        assert threading.get_ident() == caller
        seen.append(done)

    parallel = verify_checkpoint(ckpt, progress, threads=4)
    serial = verify_checkpoint(ckpt, threads=1)
    assert parallel.problems == serial.problems and len(parallel.problems) == 4
    named = [p.split(": ")[0].rsplit("/", 1)[1] for p in parallel.problems]
    assert named == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__4_0.distcp"]  # manifest order
    assert parallel.bytes_checked == serial.bytes_checked == parallel.manifest.total_bytes
    assert seen == sorted(seen) and seen[-1] == parallel.bytes_checked


def test_hashing_workers_stop_when_the_caller_raises(tmp_path, monkeypatch):
    paths = []
    for i in range(4):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes(16 << 16))  # 16 chunks of 64 KiB each
    hashed = []
    update = StreamHasher.update

    def slow_update(self, data):
        hashed.append(len(data))
        time.sleep(0.01)  # 64 chunks on 2 workers: >= 0.3 s to finish if nobody stops them
        update(self, data)

    monkeypatch.setattr(StreamHasher, "update", slow_update)

    def interrupt(n):
        raise KeyboardInterrupt  # Ctrl-C while the progress bar is drawn

    with pytest.raises(KeyboardInterrupt):
        hash_files(paths, threads=2, on_bytes=interrupt, chunk=1 << 16)
    assert not [t for t in threading.enumerate() if t.name.startswith("slurmft-verify")]
    assert len(hashed) < 32  # stopped early, not after every file was read
