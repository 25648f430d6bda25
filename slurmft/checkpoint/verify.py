"""Verifying a checkpoint against its manifest, without torch: every file present, of its size and
checksum, nothing extra, and DCP's ``.metadata`` naming only DCP's types (never unpickled).

This module owns :func:`verify_checkpoint` and its :class:`VerifyReport`, and :func:`split_files`,
the byte-balanced split by which ranks share the checksums. The manifest's format and names are
:mod:`slurmft.checkpoint.manifest`; the checksum is :mod:`slurmft.checkpoint.checksum`.

The checkpoint is untrusted input: every file is opened below a descriptor of the checkpoint
directory without following any link, only regular files are read (:mod:`slurmft.safeio`), and a
link, FIFO, device or a tree nested deeper than ``MAX_TREE_DEPTH`` is a finding, not followed.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from slurmft.safeio import UnsafeFileError, kind_of, open_dir, open_inside, read_regular
from slurmft.rundir import parse_step_dirname
from slurmft.checkpoint.pickle_scan import metadata_pickle_problem
from slurmft.checkpoint.checksum import VERIFY_THREADS, hash_files
from slurmft.checkpoint.manifest import (DCP_METADATA_NAME, MANIFEST_NAME, MAX_METADATA_BYTES, REF_PREFIX, FileEntry,
                                         Manifest, ManifestError, ManifestVersionError, parse_tmp_dirname,
                                         read_manifest)

ProgressFn = Callable[[int, int], None]


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
