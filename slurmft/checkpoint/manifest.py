"""Checkpoint manifests: what a committed checkpoint holds, with per-file checksums.

This module owns the ``manifest.json`` format (every file's size and checksum, and, for an
incremental save, the files of older checkpoints it references: ``refs``), the
names of checkpoint directories (committed ``step_N`` and in-flight ``step_N.tmp-<id>``), and
the torch-free check built on them: :func:`verify_checkpoint` (listing a run's checkpoint
directories is :mod:`slurmft.checkpoint.listing`).
The checksum itself, and reading files fast to compute it, live in :mod:`slurmft.checkpoint.checksum`.

It never imports torch: the cluster side (``slurmft ckpt``, the watcher) uses it on login nodes.
DCP's ``.metadata`` is a pickle; it is verified here by size, checksum and the globals it names
(:mod:`slurmft.checkpoint.pickle_scan`: only DCP's metadata types), never unpickled.

The checkpoint is untrusted input (the job's user writes it; root and admins read it): every
file is opened below a descriptor of the checkpoint directory without following any link, only
regular files are read (:mod:`slurmft.safeio`), and a manifest is read only up to
``MAX_MANIFEST_BYTES`` and parsed with a bounded depth. A link, FIFO or device is a finding.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from slurmft import numbers
from slurmft.safeio import UnsafeFileError, kind_of, open_dir, open_inside, read_regular
from slurmft.rundir import TMP_MARK, atomic_write_json, parse_step_dirname, step_dirname
from slurmft.checkpoint.pickle_scan import metadata_pickle_problem
from slurmft.checkpoint.checksum import HASH_ALGO, VERIFY_THREADS, hash_files
from slurmft.checkpoint.checksum import StreamHasher as StreamHasher  # re-exported for writers
from slurmft.checkpoint.checksum import hash_file as hash_file  # re-exported for export

FORMAT_VERSION = 2  # 2: ``refs``; a manifest without refs is still written as format 1
REFS_FORMAT = 2
REF_PREFIX = "../"  # a ref names a file of a sibling checkpoint: ../step_N/<file>
MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"
MAX_MANIFEST_BYTES = 64 << 20  # ~400k file entries; anything larger is refused, not parsed
MAX_METADATA_BYTES = 1 << 30  # DCP's .metadata: ~1.5 M tensors

ProgressFn = Callable[[int, int], None]


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


# ----------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyReport:
    ckpt_dir: Path
    manifest: Manifest | None
    problems: tuple[str, ...]
    bytes_checked: int

    @property
    def ok(self) -> bool:
        return not self.problems


def _files_on_disk(dir_fd: int, shown: Path, problems: list[str], rel: str = "", depth: int = 0) -> set[str]:
    """Regular files below ``dir_fd`` (relative POSIX paths); anything else is a problem, not followed."""
    found: set[str] = set()
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            name = f"{rel}{entry.name}"
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISREG(mode):
                found.add(name)
            elif stat.S_ISDIR(mode) and depth < MAX_TREE_DEPTH:
                try:
                    sub = open_dir(entry.name, dir_fd=dir_fd, shown=shown / name)
                except OSError as exc:
                    problems.append(str(exc) if isinstance(exc, UnsafeFileError)
                                    else f"{shown / name}: unreadable directory ({exc.strerror})")
                    continue
                try:
                    found |= _files_on_disk(sub, shown, problems, f"{name}/", depth + 1)
                finally:
                    os.close(sub)
            else:
                what = "nested too deeply" if stat.S_ISDIR(mode) else f"{kind_of(mode)}, not a regular file"
                problems.append(f"{shown / name}: {what}")
    if not rel:
        found.discard(MANIFEST_NAME)
    return found


MAX_TREE_DEPTH = 16  # directory levels below a checkpoint (DCP writes none)


def split_files(files: Iterable[FileEntry], parts: int) -> list[list[FileEntry]]:
    """Deal files into ``parts`` groups of about equal bytes (largest first); deterministic."""
    groups: list[list[FileEntry]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for entry in sorted(files, key=lambda f: (-f.size, f.path)):
        i = loads.index(min(loads))
        groups[i].append(entry)
        loads[i] += entry.size
    return groups


def verify_checkpoint(ckpt_dir: str | os.PathLike[str], progress: ProgressFn | None = None, *,
                      part: tuple[int, int] | None = None, threads: int = VERIFY_THREADS,
                      checksums: bool = True, dir_fd: int | None = None) -> VerifyReport:
    """Check every file of a checkpoint against its manifest: presence, size, checksum, nothing extra.

    ``progress(done_bytes, total_bytes)`` is called on the caller's thread as checksums advance.
    Problems name the file, in manifest order. ``part=(i, n)`` checksums only the i-th of n
    byte-balanced groups of files (ranks share the work and merge their problems); presence and
    sizes are always checked for every file. ``threads``: files hashed at once. ``checksums=False``
    checks only the manifest, presence, sizes and extra files (stat calls, no reads): a loader
    that checksums while it reads (:mod:`slurmft.checkpoint.verified_read`) does the rest.

    With ``dir_fd`` (a descriptor of ``ckpt_dir``) the checkpoint is read there and ``ckpt_dir``
    only names it in the problems.

    Raises :class:`ManifestVersionError` for a manifest newer than this slurmft reads: that says
    nothing about the checkpoint's integrity, so it is not reported as a problem of it.
    """
    ckpt_dir = Path(ckpt_dir)
    if part is not None and not 0 <= part[0] < part[1]:
        raise ValueError(f"part must be (index, count) with 0 <= index < count, got {part}")
    if dir_fd is not None:
        return _verify_open_dir(ckpt_dir, dir_fd, progress, part, threads, checksums)
    try:
        fd = open_dir(ckpt_dir)
    except OSError as exc:
        return unopened_report(ckpt_dir, exc)
    try:
        return _verify_open_dir(ckpt_dir, fd, progress, part, threads, checksums)
    finally:
        os.close(fd)


def unopened_report(ckpt_dir: Path, exc: OSError) -> VerifyReport:
    """The report of a checkpoint whose directory could not be opened (a link, gone, unreadable)."""
    what = str(exc) if isinstance(exc, UnsafeFileError) else f"{ckpt_dir}: unreadable ({exc.strerror})"
    return VerifyReport(ckpt_dir, None, (what,), 0)


def _verify_open_dir(ckpt_dir: Path, dir_fd: int, progress: ProgressFn | None,
                     part: tuple[int, int] | None, threads: int, checksums: bool) -> VerifyReport:
    try:
        manifest = read_manifest(ckpt_dir, dir_fd=dir_fd)
    except ManifestVersionError:
        raise
    except ManifestError as exc:
        return VerifyReport(ckpt_dir, None, (str(exc),), 0)
    problems: list[str] = []
    named_step = parse_step_dirname(ckpt_dir.name)
    if named_step is None:
        named_step = parse_tmp_dirname(ckpt_dir.name)
    if named_step is not None and named_step != manifest.step:
        problems.append(f"{ckpt_dir}: manifest says step {manifest.step}, directory name says {named_step}")
    listed = {f.path for f in manifest.files}
    if DCP_METADATA_NAME not in listed:
        problems.append(f"{ckpt_dir / DCP_METADATA_NAME}: not listed in the manifest")
    strays: list[str] = []
    on_disk = _files_on_disk(dir_fd, ckpt_dir, strays)
    problems.extend(p for p in strays if p.split(": ", 1)[0] not in {str(ckpt_dir / x) for x in listed})
    for extra in sorted(on_disk - listed):
        problems.append(f"{ckpt_dir / extra}: extra file, not listed in the manifest")
    every = manifest.every_file
    to_hash = {f.path for f in (split_files(every, part[1])[part[0]] if part else every)}
    if not checksums:
        to_hash = set()
    total = sum(f.size for f in every if f.path in to_hash)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    found: dict[str, str] = {}  # entry path -> its problem
    _check_files(dir_fd, ckpt_dir, manifest.files, to_hash, found, advance, threads)
    if manifest.refs:
        # Referenced files lie in sibling checkpoints: reached through this directory's parent
        # (never a link: '..' of an open directory) and below it without following any link.
        try:
            parent_fd = open_dir("..", dir_fd=dir_fd, shown=ckpt_dir.parent)
        except OSError as exc:
            parent_fd = None
            for entry in manifest.refs:
                found[entry.path] = f"{ckpt_dir.parent}: unreadable ({exc.strerror}), referenced file not checked"
        if parent_fd is not None:
            try:
                _check_files(parent_fd, ckpt_dir.parent, manifest.refs, to_hash, found, advance, threads,
                             strip=len(REF_PREFIX))
            finally:
                os.close(parent_fd)
            for entry in manifest.refs:
                if entry.path in found:
                    found[entry.path] += " (referenced)"
    if DCP_METADATA_NAME in to_hash and DCP_METADATA_NAME not in found:
        refused = _metadata_pickle_problem(dir_fd, ckpt_dir / DCP_METADATA_NAME)
        if refused:
            found[DCP_METADATA_NAME] = refused
    problems.extend(found[e.path] for e in every if e.path in found)
    return VerifyReport(ckpt_dir, manifest, tuple(problems), done)


def _check_files(root_fd: int, root: Path, entries: Iterable[FileEntry], to_hash: set[str],
                 found: dict[str, str], advance: Callable[[int], None], threads: int,
                 strip: int = 0) -> None:
    """Presence, kind and size of each entry below ``root_fd`` (its path minus ``strip``
    characters), then the checksums of those in ``to_hash``; problems go into ``found`` by entry
    path. A file that fails before hashing counts as checked (``advance``)."""
    hashable: list[FileEntry] = []
    for entry in entries:
        rel = entry.path[strip:]
        path = root / rel
        try:
            fd, st = open_inside(root_fd, rel, path)
            os.close(fd)
        except UnsafeFileError as exc:
            found[entry.path] = f"{path}: {_what(entry)} is {exc.what}"
        except OSError as exc:
            missing = isinstance(exc, FileNotFoundError)
            found[entry.path] = f"{path}: {_what(entry)} {'missing' if missing else f'unreadable ({exc.strerror})'}"
        else:
            if st.st_size == entry.size:
                if entry.path in to_hash:
                    hashable.append(entry)
                continue
            found[entry.path] = f"{path}: wrong size {st.st_size}, manifest says {entry.size}"
        if entry.path in to_hash:
            advance(entry.size)
    digests = hash_files([Path(e.path[strip:]) for e in hashable], threads, on_bytes=advance, dir_fd=root_fd,
                         shown_root=root)
    for entry, digest in zip(hashable, digests):
        path = root / entry.path[strip:]
        if isinstance(digest, UnsafeFileError):
            found[entry.path] = f"{path}: {_what(entry)} is {digest.what}"
        elif isinstance(digest, OSError):
            found[entry.path] = f"{path}: {_what(entry)} unreadable ({digest.strerror})"
        elif digest != entry.hash:
            found[entry.path] = f"{path}: wrong checksum {digest}, manifest says {entry.hash}"


def _metadata_pickle_problem(dir_fd: int, shown: Path) -> str | None:
    """DCP's ``.metadata`` must name only DCP's metadata types (checked without unpickling)."""
    try:
        data = read_regular(DCP_METADATA_NAME, MAX_METADATA_BYTES, dir_fd=dir_fd, shown=shown)
    except OSError as exc:
        return str(exc) if isinstance(exc, UnsafeFileError) else f"{shown}: unreadable ({exc.strerror})"
    return metadata_pickle_problem(data, str(shown))


def _what(entry: FileEntry) -> str:
    if entry.path == DCP_METADATA_NAME:
        return "DCP metadata"
    return "referenced file" if entry.path.startswith(REF_PREFIX) else "file"
