"""The DCP storage writer that makes a checkpoint atomic and checksummed.

``CommitWriter`` is a ``FileSystemWriter`` writing into ``step_N.tmp-<id>``:

* each rank writes its shard file(s) in DCP's layout through :mod:`slurmft.checkpoint.shard_writer`,
  which checksums every byte on its way to the file (nothing is read back) and fsyncs it; the
  rank then fsyncs the directory, and its write results carry its ``FileEntry`` list to the
  coordinator;
* for an incremental save (:mod:`slurmft.checkpoint.incremental`) the tensors whose bytes did not change
  are left out of the rank's files; their results point at the records of an older checkpoint,
  and the referenced files travel to the coordinator with the file entries;
* the coordinator's ``finish`` strips the file entries (so ``.metadata`` stays plain DCP metadata
  that ``dcp.load`` and ``format_utils`` read without slurmft), lets DCP write ``.metadata``,
  writes ``manifest.json``, renames the tmp dir to ``step_N`` and fsyncs the parent. DCP runs
  ``finish`` only once every rank's ``write_data`` has returned, i.e. after all shards are durable.

Fault injection for crash tests (read when a writer is created, never at import):
``SLURMFT_CKPT_FAULT=<phase>[@<step>]`` pauses the process forever at that phase (after creating
the file named by ``SLURMFT_CKPT_FAULT_MARK``) so a test can kill -9 it exactly there;
``SLURMFT_CKPT_FAULT_DELAY=<seconds>`` sleeps a random time up to that at every phase;
``SLURMFT_CKPT_FAULT_SLOW=<phase>[@<step>]=<seconds>[,...]`` sleeps exactly that long at that phase
(``load``: every rank, before a checkpoint's files are read), standing for slow storage in tests of
what waits on a long save or load.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Generator

import torch
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from slurmft.rundir import fsync_dir
from slurmft.safeio import open_dir
from slurmft.checkpoint import torch_compat
from slurmft.checkpoint.incremental import SaveDelta
from slurmft.checkpoint.manifest import FileEntry, Manifest, build_manifest, tmp_dirname, write_manifest
from slurmft.checkpoint.retention import read_references, scan_checkpoint_dirs
from slurmft.checkpoint.shard_writer import ShardStream, write_shard_file

# Rank-local phases run on every rank; the others on the coordinator only, in this order.
PHASES = ("write", "shards_written", "shards_synced", "metadata_written", "manifest_written",
          "renamed", "committed")
# With the node-local tier (slurmft.checkpoint.local_tier): every rank, its files copied to the run
# dir's tmp dir, before the commit there.
TIER_PHASES = ("shared_copy",)
FAULT_ENV = "SLURMFT_CKPT_FAULT"
FAULT_MARK_ENV = "SLURMFT_CKPT_FAULT_MARK"
FAULT_DELAY_ENV = "SLURMFT_CKPT_FAULT_DELAY"
FAULT_SLOW_ENV = "SLURMFT_CKPT_FAULT_SLOW"
LOAD_PHASE = "load"
_FILES_FQN = "__slurmft_files__"


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """Where to pause or how long to dawdle; built from the environment by :meth:`from_env`."""

    pause_phase: str | None = None
    pause_step: int | None = None
    mark: Path | None = None
    max_delay_s: float = 0.0
    slow: tuple[tuple[str, int | None, float], ...] = ()  # (phase, step or any, seconds)

    @classmethod
    def from_env(cls) -> "FaultPlan":
        spec = os.environ.get(FAULT_ENV, "")
        phase, _, step = spec.partition("@")
        if phase and phase not in PHASES + TIER_PHASES:
            raise ValueError(f"${FAULT_ENV}: unknown phase {phase!r}; phases: {', '.join(PHASES + TIER_PHASES)}")
        mark = os.environ.get(FAULT_MARK_ENV)
        return cls(phase or None, int(step) if step else None, Path(mark) if mark else None,
                   float(os.environ.get(FAULT_DELAY_ENV, "0") or 0),
                   _slow_spec(os.environ.get(FAULT_SLOW_ENV, "")))

    def at(self, phase: str, step: int) -> None:
        if self.max_delay_s > 0:
            time.sleep(random.uniform(0, self.max_delay_s))
        for where, at_step, seconds in self.slow:
            if where == phase and at_step in (None, step):
                time.sleep(seconds)
        if phase == self.pause_phase and (self.pause_step is None or self.pause_step == step):
            if self.mark is not None:
                fd = os.open(self.mark, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.write(fd, f"{phase} {step} {os.getpid()}\n".encode())
                os.close(fd)
            while True:  # paused for the test's kill -9
                time.sleep(60)


def _slow_spec(spec: str) -> tuple[tuple[str, int | None, float], ...]:
    """``<phase>[@<step>]=<seconds>,...`` (``$SLURMFT_CKPT_FAULT_SLOW``) parsed and checked."""
    phases = PHASES + TIER_PHASES + (LOAD_PHASE,)
    found = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        where, _, seconds = item.partition("=")
        phase, _, step = where.partition("@")
        try:
            delay = float(seconds)
            at_step = int(step) if step else None
        except ValueError:
            raise ValueError(f"${FAULT_SLOW_ENV}: {item!r} is not <phase>[@<step>]=<seconds>") from None
        if phase not in phases or not 0 <= delay <= 3600:
            raise ValueError(f"${FAULT_SLOW_ENV}: {item!r}: the phase must be one of {', '.join(phases)} "
                             "and the seconds between 0 and 3600")
        found.append((phase, at_step, delay))
    return tuple(found)


class _HashingFileSystem(FileSystem):
    """DCP's local FileSystem, recording a FileEntry for every file written under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.entries: dict[str, FileEntry] = {}
        self._lock = threading.Lock()

    def record(self, entry: FileEntry) -> None:
        with self._lock:
            self.entries[entry.path] = entry

    def _rel(self, path: Any) -> str:
        return Path(path).relative_to(self.root).as_posix()

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = ShardStream(Path(path))
        try:
            yield stream
        finally:
            stream.close()
        self.record(FileEntry(self._rel(path), stream.hasher.size, stream.hasher.hexdigest()))

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.entries.pop(self._rel(path), None)
            if entry is not None:
                new = dataclasses.replace(entry, path=self._rel(new_path))
                self.entries[new.path] = new


class CommitWriter(FileSystemWriter):
    """Writes one checkpoint into its tmp dir and commits it by renaming to ``final_dir``."""

    def __init__(self, final_dir: Path, tmp_id: str, step: int, world_size: int, *,
                 job_id: str | None = None, restart_count: int | None = None,
                 thread_count: int = 1, faults: FaultPlan | None = None,
                 before_write: Callable[[], None] | None = None, delta: SaveDelta | None = None,
                 commit: bool = True, recorded_as: Path | None = None) -> None:
        self.final_dir = Path(final_dir)
        tmp_dir = self.final_dir.parent / tmp_dirname(step, tmp_id)
        super().__init__(tmp_dir, single_file_per_rank=True, sync_files=True,
                         thread_count=thread_count, overwrite=False)
        self.step = step
        self.world_size = world_size
        self.job_id = job_id
        self.restart_count = restart_count
        self.faults = faults or FaultPlan()
        # Raises when this rank's staged bytes cannot be trusted: inside write_data, so DCP fails
        # the save on every rank instead of committing it or leaving the others in a collective.
        self.before_write = before_write
        self.delta = delta  # incremental: what this rank need not write again
        # False (the node-local tier): finish writes .metadata and the manifest but leaves the
        # tmp dir for slurmft.checkpoint.local_tier to replicate and commit on every node.
        self.commit = commit
        self.recorded_as = Path(recorded_as) if recorded_as is not None else self.final_dir
        self.manifest: Manifest | None = None
        self.hashing = _HashingFileSystem(Path(self.path))
        self.fs = self.hashing
        self.bytes_written = 0

    @property
    def own_files(self) -> tuple[FileEntry, ...]:
        """The shard files this rank wrote (not .metadata)."""
        return tuple(e for e in self.hashing.entries.values() if e.path != ".metadata")

    def storage_meta(self) -> StorageMeta | None:
        # .metadata records where the checkpoint lives once committed, not the tmp name.
        # (The local tier's: the run dir's, where the checkpoint is meant to end up.)
        return StorageMeta(checkpoint_id=str(self.recorded_as), save_id=self.save_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # DCP's own write_data would do the same split into files (one per writer thread), but
        # through torch.save with its CRC-32 and a buffered stream; see slurmft.checkpoint.shard_writer.
        # Without the private APIs that needs, DCP's own (public) path writes them instead.
        if self.before_write is not None:
            self.before_write()
        reused: list[WriteResult] = []
        if self.delta is not None:
            plan, reused = self.delta.split(plan, planner)
        if not torch_compat.FAST_SHARD_WRITE:
            self.faults.at("write", self.step)
            results = super().write_data(plan, planner).wait()
            return self._shards_done(results, reused)
        prefix = plan.storage_data.prefix
        jobs = [(f"{prefix}{i}{DEFAULT_SUFFIX}", items)
                for i, items in enumerate(torch_compat.split_by_size_and_type(self.thread_count, plan.items))]

        def write(job: tuple[str, list[Any]]) -> list[WriteResult]:
            name, items = job
            written = write_shard_file(Path(self.path) / name, name, items, planner,
                                       on_first_write=lambda: self.faults.at("write", self.step))
            self.hashing.record(written.entry)
            return written.results

        if len(jobs) == 1:
            per_file = [write(jobs[0])]
        else:
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="slurmft-shard") as pool:
                per_file = list(pool.map(write, jobs))
        return self._shards_done([r for file_results in per_file for r in file_results], reused)

    def _shards_done(self, results: list[WriteResult], reused: list[WriteResult]) -> Future[list[WriteResult]]:
        """Every shard file is written and fsynced: sync the dir, hand the file list on."""
        self.faults.at("shards_written", self.step)
        fsync_dir(Path(self.path))
        self.faults.at("shards_synced", self.step)
        entries = tuple(self.hashing.entries.values())
        self.bytes_written = sum(e.size for e in entries)
        refs: tuple[FileEntry, ...] = ()
        if self.delta is not None:
            self.delta.wrote(results, self.hashing.entries, self.final_dir.name, Path(self.path))
            refs = tuple(self.delta.refs.values())
        carrier = WriteResult(index=MetadataIndex(_FILES_FQN), size_in_bytes=0,
                              storage_data=(str(self.path), entries, refs))
        done: Future[list[WriteResult]] = Future()
        done.set_result([*results, *reused, carrier])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: list[FileEntry] = []
        refs: set[FileEntry] = set()
        plain: list[list[WriteResult]] = []
        for rank, rank_results in enumerate(results):
            plain.append([r for r in rank_results if r.index.fqn != _FILES_FQN])
            for r in rank_results:
                if r.index.fqn == _FILES_FQN:
                    rank_dir, entries, rank_refs = r.storage_data
                    if Path(rank_dir).name != Path(self.path).name:
                        # DCP would happily pair up saves of different steps; never commit that.
                        # (Names only: in the local tier every node writes its own directory.)
                        raise RuntimeError(f"rank {rank} wrote {rank_dir}, coordinator wrote {self.path}")
                    files.extend(entries)
                    refs.update(rank_refs)
        super().finish(metadata, plain)
        self.faults.at("metadata_written", self.step)
        files.extend(e for e in self.hashing.entries.values() if e.path == ".metadata")
        manifest = build_manifest(self.step, self.world_size, torch.__version__, files,
                                  job_id=self.job_id, restart_count=self.restart_count, refs=refs)
        write_manifest(self.path, manifest)  # fsyncs the file and the tmp dir (covers .metadata)
        self.manifest = manifest
        self.faults.at("manifest_written", self.step)
        if not self.commit:
            return
        self._rename_into_place()
        self.faults.at("renamed", self.step)
        fsync_dir(self.final_dir.parent)
        self.faults.at("committed", self.step)

    def _rename_into_place(self) -> None:
        if self.final_dir.exists():
            # Re-saving a step already committed (e.g. after a rollback): the newer save wins;
            # the old one becomes an abandoned tmp dir that retention removes, unless a newer
            # checkpoint's incremental save references its files: then this save fails instead.
            self._refuse_replacing_referenced()
            aside = self.final_dir.parent / tmp_dirname(self.step, f"replaced-{self.save_id[:12]}")
            os.rename(self.final_dir, aside)
        os.rename(self.path, self.final_dir)

    def _refuse_replacing_referenced(self) -> None:
        parent = self.final_dir.parent
        fd = open_dir(parent)
        try:
            newer = [s for s in scan_checkpoint_dirs(parent.parent, ckpt_fd=fd)[0] if s > self.step]
            users = sorted(s for s, refs in read_references(fd, newer).items()
                           if refs is None or self.step in refs)
        finally:
            os.close(fd)
        if users:
            raise RuntimeError(f"{self.final_dir} is already committed and step(s) "
                               f"{', '.join(map(str, users))} reference its files (incremental saves); "
                               f"not replacing it")
