"""Listing a run's checkpoint directories: committed and in-flight, each with its manifest or the
error reading it, and the entries of ``checkpoints/`` that are no checkpoint (links, special files,
non-canonical names), which every reader ignores and ``slurmft ckpt`` names. No checksums are read.

``checkpoints`` is opened without following a link (a linked one raises
:class:`slurmft.safeio.UnsafeFileError`), or given as a descriptor (``ckpt_fd``) by a caller that
opened the run dir once, and everything below it is reached relative to a descriptor: no entry is
followed and no path is looked up again. Torch-free.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from slurmft.rundir import STEP_PREFIX, RunDir, parse_step_dirname, step_dirname
from slurmft.safeio import UnsafeFileError, kind_of, lstat_at, open_dir
from slurmft.checkpoint.manifest import (MANIFEST_NAME, Manifest, ManifestError, ManifestVersionError,
                                    parse_tmp_dirname, read_manifest)



@dataclass(frozen=True)
class CheckpointInfo:
    """One directory under ``<run_dir>/checkpoints``: committed or tmp, with its manifest or error."""

    path: Path
    step: int
    committed: bool
    size_bytes: int
    mtime: float
    manifest: Manifest | None
    error: str | None
    newer_format: bool = False  # the manifest is from a newer slurmft: unknown, not damaged

    @property
    def name(self) -> str:
        return self.path.name


def _dir_size(dir_fd: int) -> int:
    """Bytes of the files below the directory ``dir_fd`` (no link followed)."""
    total = 0
    for _top, _dirs, names, fd in os.fwalk(".", dir_fd=dir_fd):
        for name in names:
            try:
                total += os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
            except FileNotFoundError:  # removed while we walk (retention, a save finishing)
                pass
    return total


def list_checkpoints(run_dir: str | os.PathLike[str], *, ckpt_fd: int | None = None) -> list[CheckpointInfo]:
    """Committed and tmp checkpoint dirs of a run, by step (tmp after committed); no checksums read.

    A committed dir whose manifest cannot be read carries the error; a tmp dir usually has no
    manifest yet, which is not an error for it. Links and other non-directories are not listed
    (see :func:`stray_entries`). ``ckpt_fd``: a descriptor of ``<run_dir>/checkpoints``, read
    instead of the path. Raises :class:`UnsafeFileError` when ``checkpoints`` is a link.
    """
    root = RunDir(Path(run_dir)).checkpoints
    if ckpt_fd is not None:
        return _list_below(ckpt_fd, root)
    try:
        root_fd = open_dir(root)
    except FileNotFoundError:
        return []
    try:
        return _list_below(root_fd, root)
    finally:
        os.close(root_fd)


def _list_below(root_fd: int, root: Path) -> list[CheckpointInfo]:
    infos = []
    for entry in list(os.scandir(root_fd)):
        if not entry.is_dir(follow_symlinks=False):
            continue
        step = parse_step_dirname(entry.name)
        committed = step is not None
        if step is None:
            step = parse_tmp_dirname(entry.name)
        if step is None:
            continue
        info = _describe(root_fd, root / entry.name, step, committed)
        if info is not None:
            infos.append(info)
    infos.sort(key=lambda i: (i.step, not i.committed, i.name))
    return infos


def _describe(root_fd: int, path: Path, step: int, committed: bool) -> CheckpointInfo | None:
    """One checkpoint dir, read below ``root_fd``; None when it is gone (or no longer a directory)."""
    try:
        fd = open_dir(path.name, dir_fd=root_fd, shown=path)
    except (FileNotFoundError, UnsafeFileError):  # deleted, or swapped for a link, since the scan
        return None
    except OSError as exc:
        st = lstat_at(path.name, root_fd)
        if st is None:
            return None
        return CheckpointInfo(path, step, committed, 0, st.st_mtime, None, f"{path}: unreadable ({exc.strerror})")
    try:
        manifest, error, newer = None, None, False
        try:
            manifest = read_manifest(path, dir_fd=fd)
        except ManifestError as exc:
            if committed or lstat_at(MANIFEST_NAME, fd) is not None:
                error, newer = str(exc), isinstance(exc, ManifestVersionError)
        if manifest is not None and manifest.step != step:
            error = f"{path}: manifest says step {manifest.step}, directory name says {step}"
        return CheckpointInfo(path, step, committed, _dir_size(fd), os.fstat(fd).st_mtime, manifest, error,
                              newer)
    finally:
        os.close(fd)


def stray_entries(run_dir: str | os.PathLike[str], *, ckpt_fd: int | None = None) -> list[str]:
    """One line per entry of ``<run_dir>/checkpoints`` (or the directory ``ckpt_fd``) that is no
    checkpoint and is therefore ignored: a link, a special file, a checkpoint-like name that is not
    canonical."""
    root = RunDir(Path(run_dir)).checkpoints
    if ckpt_fd is not None:
        return _strays_below(ckpt_fd, root)
    try:
        root_fd = open_dir(root)
    except FileNotFoundError:
        return []
    try:
        return _strays_below(root_fd, root)
    finally:
        os.close(root_fd)


def _strays_below(root_fd: int, root: Path) -> list[str]:
    out = []
    with os.scandir(root_fd) as entries:
        for entry in entries:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            named = parse_step_dirname(entry.name) is not None or parse_tmp_dirname(entry.name) is not None
            if named and not stat.S_ISDIR(mode):
                out.append(f"{root / entry.name}: {kind_of(mode)}, not a checkpoint directory; ignored")
            elif not named and entry.name.startswith(STEP_PREFIX):
                out.append(f"{root / entry.name!s}: not a canonical checkpoint name "
                           f"({step_dirname(0)}-style ASCII digits); ignored")
    return sorted(out)
