"""Listing a run's checkpoint directories: committed and in-flight, each with its manifest or the
error reading it, and the entries of ``checkpoints/`` that are no checkpoint (links, special files,
non-canonical names), which every reader ignores and ``slurmft ckpt`` names. No checksums are read.

``checkpoints`` is opened without following a link (a linked one raises
:class:`slurmft.safeio.UnsafeFileError`), and no entry is followed. Torch-free.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from slurmft.rundir import STEP_PREFIX, RunDir, parse_step_dirname, step_dirname
from slurmft.safeio import kind_of, open_dir
from slurmft.train.manifest import (MANIFEST_NAME, Manifest, ManifestError, ManifestVersionError,
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


def _dir_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # removed while we walk (retention, a save finishing)
                pass
    return total


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Committed and tmp checkpoint dirs of a run, by step (tmp after committed); no checksums read.

    A committed dir whose manifest cannot be read carries the error; a tmp dir usually has no
    manifest yet, which is not an error for it. Links and other non-directories are not listed
    (see :func:`stray_entries`). Raises :class:`UnsafeFileError` when ``checkpoints`` is a link.
    """
    root = RunDir(Path(run_dir)).checkpoints
    try:
        root_fd = open_dir(root)
    except FileNotFoundError:
        return []
    try:
        entries = list(os.scandir(root_fd))
    finally:
        os.close(root_fd)
    infos = []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        step = parse_step_dirname(entry.name)
        committed = step is not None
        if step is None:
            step = parse_tmp_dirname(entry.name)
        if step is None:
            continue
        path = root / entry.name
        manifest, error, newer = None, None, False
        try:
            manifest = read_manifest(path)
        except ManifestError as exc:
            if committed or os.path.lexists(path / MANIFEST_NAME):
                error, newer = str(exc), isinstance(exc, ManifestVersionError)
        if manifest is not None and manifest.step != step:
            error = f"{path}: manifest says step {manifest.step}, directory name says {step}"
        try:
            mtime = os.stat(path, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        infos.append(CheckpointInfo(path, step, committed, _dir_size(path), mtime, manifest, error, newer))
    infos.sort(key=lambda i: (i.step, not i.committed, i.name))
    return infos


def stray_entries(run_dir: str | os.PathLike[str]) -> list[str]:
    """One line per entry of ``<run_dir>/checkpoints`` that is no checkpoint and is therefore
    ignored: a link, a special file, a checkpoint-like name that is not canonical."""
    root = RunDir(Path(run_dir)).checkpoints
    try:
        root_fd = open_dir(root)
    except FileNotFoundError:
        return []
    out = []
    try:
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
    finally:
        os.close(root_fd)
    return sorted(out)
