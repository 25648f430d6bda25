"""Checkpoint manifests: what a committed checkpoint holds, with per-file checksums.

This module owns the ``manifest.json`` format (every file's size and checksum, and, for an
incremental save, the files of older checkpoints it references: ``refs``) and the names of
checkpoint directories (committed ``step_N`` and in-flight ``step_N.tmp-<id>``). The torch-free
check built on them is :mod:`slurmft.checkpoint.verify`; listing a run's checkpoint directories is
:mod:`slurmft.checkpoint.listing`; the checksum itself, and reading files fast to compute it,
:mod:`slurmft.checkpoint.checksum`.

It never imports torch: the cluster side (``slurmft ckpt``, the watcher) uses it on login nodes.

The manifest is untrusted input (the job's user writes it; root and admins read it): it is opened
below a descriptor of the checkpoint directory without following any link, read only up to
``MAX_MANIFEST_BYTES`` as a regular file (:mod:`slurmft.safeio`), and parsed with a bounded depth.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from slurmft import numbers
from slurmft.safeio import UnsafeFileError, open_dir, read_regular
from slurmft.rundir import TMP_MARK, atomic_write_json, parse_step_dirname, step_dirname
from slurmft.checkpoint.checksum import HASH_ALGO
from slurmft.checkpoint.checksum import StreamHasher as StreamHasher  # re-exported for writers
from slurmft.checkpoint.checksum import hash_file as hash_file  # re-exported for export

FORMAT_VERSION = 2  # 2: ``refs``; a manifest without refs is still written as format 1
REFS_FORMAT = 2
REF_PREFIX = "../"  # a ref names a file of a sibling checkpoint: ../step_N/<file>
MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"
MAX_MANIFEST_BYTES = 64 << 20  # ~400k file entries; anything larger is refused, not parsed
MAX_METADATA_BYTES = 1 << 30  # DCP's .metadata: ~1.5 M tensors



class ManifestError(Exception):
    """A manifest is missing, unreadable or malformed; the message names the file and the field."""


class ManifestUnreadable(ManifestError):
    """The manifest is there but could not be read (an I/O or permission error): it may read
    another time, unlike a missing, unsafe or malformed one, which never will."""


class ManifestVersionError(ManifestError):
    """The manifest is in a format newer than this slurmft reads: not damage, an old slurmft.

    Never a reason to skip or delete the checkpoint; the fix is to upgrade slurmft.
    """

    def __init__(self, where: str, found: int, known: int) -> None:
        super().__init__(f"{where}: written by a newer slurmft (format {found}, this one reads up to "
                         f"{known}): upgrade slurmft")
        self.found = found
        self.known = known


# ----------------------------------------------------------------------------- directory names


def tmp_dirname(step: int, tmp_id: str) -> str:
    """``step_000001300.tmp-<id>``: where a save writes before it is committed by a rename."""
    if not tmp_id or not all(c.isalnum() or c in "-_" for c in tmp_id):
        raise ValueError(f"tmp id must be non-empty [A-Za-z0-9_-], got {tmp_id!r}")
    return f"{step_dirname(step)}{TMP_MARK}{tmp_id}"


def parse_tmp_dirname(name: str) -> int | None:
    """The step of an in-flight/abandoned ``step_N.tmp-<id>`` name, or None for anything else."""
    head, mark, tmp_id = name.partition(TMP_MARK)
    if not mark or not tmp_id:
        return None
    return parse_step_dirname(head)


# ----------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the checkpoint dir (POSIX), size, checksum."""

    path: str
    size: int
    hash: str


@dataclass(frozen=True)
class Manifest:
    format_version: int
    step: int
    world_size: int
    torch_version: str
    job_id: str | None
    restart_count: int | None
    created_at: float
    files: tuple[FileEntry, ...]
    hash_algo: str = HASH_ALGO
    extra: dict[str, Any] = field(default_factory=dict, hash=False)
    # Files of older checkpoints holding tensors this one did not write again (incremental save).
    refs: tuple[FileEntry, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Bytes of this checkpoint's own files (what its directory holds)."""
        return sum(f.size for f in self.files)

    @property
    def every_file(self) -> tuple[FileEntry, ...]:
        """Own files and referenced ones: everything a load of this checkpoint may read."""
        return self.files + self.refs

    @property
    def referenced_steps(self) -> frozenset[int]:
        """Steps of the checkpoints whose files this one references (they must be kept)."""
        return frozenset(ref_step(f.path) for f in self.refs)

    def to_json(self) -> dict[str, Any]:
        refs = {"refs": [{"path": f.path, "size": f.size, "hash": f.hash} for f in self.refs]} if self.refs else {}
        return {
            "format_version": self.format_version,
            "step": self.step,
            "world_size": self.world_size,
            "torch_version": self.torch_version,
            "job_id": self.job_id,
            "restart_count": self.restart_count,
            "created_at": self.created_at,
            "hash_algo": self.hash_algo,
            "files": [{"path": f.path, "size": f.size, "hash": f.hash} for f in self.files],
            "extra": self.extra,
            **refs,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST_NAME) -> "Manifest":
        """Validate parsed JSON; every error names ``where`` and the offending field."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
        version = _field(data, "format_version", int, where)
        if version > FORMAT_VERSION:
            raise ManifestVersionError(where, version, FORMAT_VERSION)
        if version < 1:
            raise ManifestError(f"{where}: format_version must be >= 1, got {version}")
        step = _field(data, "step", int, where)
        files = _entries(_field(data, "files", list, where), f"{where}: files", None)
        refs: tuple[FileEntry, ...] = ()
        if "refs" in data:
            if version < REFS_FORMAT:
                raise ManifestError(f"{where}: field 'refs' needs format_version {REFS_FORMAT}, got {version}")
            refs = _entries(_field(data, "refs", list, where), f"{where}: refs", step)
        manifest = cls(
            format_version=version,
            step=step,
            world_size=_field(data, "world_size", int, where),
            torch_version=_field(data, "torch_version", str, where),
            job_id=_field(data, "job_id", (str, type(None)), where),
            restart_count=_field(data, "restart_count", (int, type(None)), where),
            created_at=_unix_time(_field(data, "created_at", (int, float), where), "created_at", where),
            files=files,
            hash_algo=_field(data, "hash_algo", str, where),
            extra=_field(data, "extra", dict, where),
            refs=refs,
        )
        if numbers.count(manifest.step) is None or numbers.whole(manifest.world_size, 1) is None:
            raise ManifestError(f"{where}: step must be >= 0 and world_size >= 1 (both at most "
                                f"{numbers.MAX_INT64}), got {numbers.shown(manifest.step)} and "
                                f"{numbers.shown(manifest.world_size)}")
        if manifest.restart_count is not None and numbers.count(manifest.restart_count) is None:
            raise ManifestError(f"{where}: restart_count must be from 0 to {numbers.MAX_INT64}, "
                                f"got {numbers.shown(manifest.restart_count)}")
        if manifest.hash_algo != HASH_ALGO:
            raise ManifestError(f"{where}: unknown hash_algo {manifest.hash_algo!r} (know {HASH_ALGO})")
        return manifest


def _entries(raw_entries: list[Any], where: str, referenced_by: int | None) -> tuple[FileEntry, ...]:
    """File entries; with ``referenced_by`` (the manifest's step) each must name a file of an
    older checkpoint as ``../step_N/<file>``, else a plain path inside the checkpoint."""
    entries = []
    for i, raw in enumerate(raw_entries):
        at = f"{where}[{i}]"
        if not isinstance(raw, dict):
            raise ManifestError(f"{at}: expected an object")
        entry = FileEntry(_field(raw, "path", str, at), _field(raw, "size", int, at),
                          _field(raw, "hash", str, at))
        if referenced_by is None and not _is_plain_relative(entry.path):
            raise ManifestError(f"{at}: path {entry.path!r} must be relative, inside the checkpoint")
        if referenced_by is not None:
            step = ref_step(entry.path)
            if step < 0 or step >= referenced_by:
                raise ManifestError(f"{at}: path {entry.path!r} must be {REF_PREFIX}<older step_N "
                                    f"directory>/<file>")
        if numbers.count(entry.size) is None:
            raise ManifestError(f"{at}: size must be >= 0 (and at most {numbers.MAX_INT64}), got "
                                f"{numbers.shown(entry.size)}")
        entries.append(entry)
    return tuple(entries)


def ref_step(path: str) -> int:
    """The step of the checkpoint a ref path ``../step_N/<file>`` names; -1 if it is no such path."""
    if not path.startswith(REF_PREFIX):
        return -1
    head, _, rest = path[len(REF_PREFIX):].partition("/")
    step = parse_step_dirname(head)
    return -1 if step is None or not _is_plain_relative(rest) else step


def ref_target(path: str) -> str:
    """A ref's path below the checkpoints directory (``step_N/<file>``)."""
    return path[len(REF_PREFIX):]


def _field(data: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in data:
        raise ManifestError(f"{where}: missing field {name!r}")
    value = data[name]
    bad_bool = isinstance(value, bool) and kind is not bool
    if bad_bool or not isinstance(value, kind):
        raise ManifestError(f"{where}: field {name!r} has the wrong type ({type(value).__name__})")
    return value


def _unix_time(value: int | float, name: str, where: str) -> float:
    """A manifest's time: a unix time (1970 to year 9999), else ManifestError naming the field."""
    when = numbers.unix_time(value)
    if when is None:
        raise ManifestError(f"{where}: field {name!r} must be a unix time, got {numbers.shown(value)}")
    return when


def _is_plain_relative(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def parse_json_bounded(raw: bytes, where: str) -> Any:
    """Parse untrusted JSON: ValueError naming ``where`` for bad bytes, too deep a nesting or a
    number too long to convert (Python refuses integers of more than 4300 digits)."""
    try:
        return numbers.loads(raw)  # NaN, Infinity and 1e400 are not JSON here either
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integer string too long, nesting
        raise ValueError(f"{where}: not valid JSON ({_one_line(str(exc))})") from None


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def read_manifest(ckpt_dir: str | os.PathLike[str], *, dir_fd: int | None = None) -> Manifest:
    """The manifest of ``ckpt_dir``; :class:`ManifestError` if missing, unreadable or malformed.

    Neither ``ckpt_dir`` nor its manifest may be a link; the manifest must be a regular file of
    at most ``MAX_MANIFEST_BYTES``. With ``dir_fd`` (a descriptor of ``ckpt_dir``) it is read there.
    """
    path = Path(ckpt_dir) / MANIFEST_NAME
    try:
        if dir_fd is None:
            fd = open_dir(ckpt_dir)
            try:
                raw = read_regular(MANIFEST_NAME, MAX_MANIFEST_BYTES, dir_fd=fd, shown=path)
            finally:
                os.close(fd)
        else:
            raw = read_regular(MANIFEST_NAME, MAX_MANIFEST_BYTES, dir_fd=dir_fd, shown=path)
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing") from None
    except UnsafeFileError as exc:
        raise ManifestError(str(exc)) from None
    except OSError as exc:
        raise ManifestUnreadable(f"{path}: unreadable ({exc.strerror})") from None
    try:
        data = parse_json_bounded(raw, str(path))
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    return Manifest.from_json(data, str(path))


def write_manifest(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write ``manifest.json`` into ``ckpt_dir`` atomically and durably."""
    atomic_write_json(Path(ckpt_dir) / MANIFEST_NAME, manifest.to_json())


def build_manifest(step: int, world_size: int, torch_version: str, files: Iterable[FileEntry], *,
                   job_id: str | None = None, restart_count: int | None = None,
                   extra: dict[str, Any] | None = None, refs: Iterable[FileEntry] = ()) -> Manifest:
    """A manifest, files sorted by path, stamped with the wall time now; format 1 (readable by
    every slurmft) unless it has refs."""
    refs = tuple(sorted(set(refs), key=lambda f: f.path))
    return Manifest(REFS_FORMAT if refs else 1, step, world_size, torch_version, job_id, restart_count,
                    time.time(), tuple(sorted(files, key=lambda f: f.path)), HASH_ALGO,
                    dict(extra or {}), refs)
