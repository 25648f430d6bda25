"""The run directory a ``slurmft ckpt`` command works in: opened once, not through a link, and
everything below looked up relative to that descriptor (:class:`OpenRun`); a checkpoint named by
step or directory name resolved in it; bad input turned into one line and exit 2."""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NoReturn, ParamSpec, TypeVar

import typer

from slurmft.rundir import CHECKPOINTS, STEP_PREFIX, RunDir, parse_step_dirname
from slurmft.safeio import UnsafeFileError, kind_of, lstat_at, open_dir
from slurmft.checkpoint.listing import stray_entries
from slurmft.checkpoint.manifest import (MANIFEST_NAME, Manifest, ManifestError, parse_tmp_dirname, read_manifest)
from slurmft.checkpoint.retention import (scan_checkpoint_dirs)

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE = 0, 1, 2


def fail(message: str) -> NoReturn:
    print(f"slurmft ckpt: {message}", file=sys.stderr)
    raise typer.Exit(EXIT_USAGE)


P = ParamSpec("P")
R = TypeVar("R")


def bad_input_is_usage(command: Callable[P, R]) -> Callable[P, R]:
    """Exit 2 with one line for what bad input raises (a file system error on a path the user
    named or wrote, an over-long name, a nesting too deep): never a traceback with exit 1, which
    means "a checkpoint failed verification"."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            fail(f"{where}{exc.strerror or exc}")
        except (RecursionError, ValueError) as exc:
            fail(f"bad input: {' '.join(str(exc).split())[:300]}")

    return wrapper


def warn_strays(run: OpenRun) -> None:
    for line in stray_entries(run.root, ckpt_fd=run.ckpt_fd):
        print(f"slurmft ckpt: {line}", file=sys.stderr)


@dataclass
class OpenRun:
    """A run directory opened once, without following a link. ``root`` and the paths made from it
    only name things in messages: every lookup goes through ``ckpt_fd``, a descriptor of its
    ``checkpoints/``, so a path swapped afterwards (for a link to another run) changes nothing."""

    root: Path
    ckpt_fd: int

    @property
    def checkpoints(self) -> Path:
        return RunDir(self.root).checkpoints

    def checkpoint(self, step: int) -> Path:
        return RunDir(self.root).checkpoint(step)

    def committed_steps(self) -> list[int]:
        return scan_checkpoint_dirs(self.root, ckpt_fd=self.ckpt_fd)[0]

    def open_checkpoint(self, ckpt_dir: Path) -> int:
        """A descriptor of the checkpoint dir ``ckpt_dir`` names, opened below ``ckpt_fd``, no link followed."""
        return open_dir(ckpt_dir.name, dir_fd=self.ckpt_fd, shown=ckpt_dir)

    @contextlib.contextmanager
    def opened(self, ckpt_dir: Path) -> Iterator[int]:
        """:meth:`open_checkpoint`, closed after the block."""
        fd = self.open_checkpoint(ckpt_dir)
        try:
            yield fd
        finally:
            os.close(fd)

    def __enter__(self) -> "OpenRun":
        return self

    def __exit__(self, *_exc: object) -> None:
        os.close(self.ckpt_fd)


def open_run_dir(path: Path) -> OpenRun:
    """The run directory at ``path``, opened once; or a one-line error saying what ``path`` is instead."""
    try:
        run_fd = open_dir(path)
    except FileNotFoundError:
        fail(f"{path}: no such directory")
    except UnsafeFileError as exc:
        if exc.what.startswith("a symbolic link"):
            fail(f"{path}: a symbolic link; name the run directory itself, not a link to it (not followed)")
        fail(f"{path}: not a directory")
    except NotADirectoryError:
        fail(f"{path}: not a directory")
    except OSError as exc:
        fail(f"{path}: {exc.strerror}")
    try:
        return OpenRun(Path(path), _open_checkpoints(Path(path), run_fd))
    finally:
        os.close(run_fd)


def _open_checkpoints(path: Path, run_fd: int) -> int:
    """A descriptor of ``checkpoints/`` below the run dir ``run_fd`` (``path`` names it)."""
    name = path.name
    if lstat_at(MANIFEST_NAME, run_fd) is not None or parse_step_dirname(name) is not None \
            or parse_tmp_dirname(name) is not None:
        fail(f"{path} is a checkpoint directory; pass its run directory ({path.parent.parent})")
    checkpoints = RunDir(path).checkpoints
    try:
        return open_dir(CHECKPOINTS, dir_fd=run_fd, shown=checkpoints)
    except UnsafeFileError as exc:
        if exc.what.startswith("a symbolic link"):
            fail(f"{checkpoints}: a symbolic link; a run's checkpoints must be a real directory inside it "
                  f"(not followed)")
        fail(f"{path} is not a slurmft run directory (no {CHECKPOINTS}/ inside)")
    except (FileNotFoundError, NotADirectoryError):
        fail(f"{path} is not a slurmft run directory (no {CHECKPOINTS}/ inside)")


def resolve_checkpoint(run: OpenRun, selector: str) -> Path:
    """The committed checkpoint named by ``selector`` (a step number or a ``step_N`` dir name)."""
    name = Path(selector).name
    tmp_step = parse_tmp_dirname(name)
    if tmp_step is not None:
        fail(f"{name} is an in-flight or abandoned checkpoint (a .tmp- directory), never loaded; "
              f"name a committed step (see 'slurmft ckpt ls')")
    step: int | None
    if name.isascii() and name.isdigit() and len(name) <= 20:
        step = int(name)
    else:
        step = parse_step_dirname(name)
        if step is None:
            shown = selector if len(selector) <= 60 else f"{selector[:40]}...({len(selector)} characters)"
            fail(f"{shown!r} is not a step number or a {STEP_PREFIX}N directory name")
    path = run.checkpoint(step)
    found = lstat_at(path.name, run.ckpt_fd)
    if found is not None:
        if stat.S_ISDIR(found.st_mode):
            return path
        fail(f"{path}: {kind_of(found.st_mode)}, not a checkpoint directory (not followed)")
    committed, tmp_dirs = scan_checkpoint_dirs(run.root, ckpt_fd=run.ckpt_fd)
    pending = [n for n in tmp_dirs if parse_tmp_dirname(n) == step]
    if pending:
        fail(f"step {step} was never committed (only {', '.join(pending)}: in flight or abandoned)")
    fail(f"no checkpoint for step {step} in {run.checkpoints} "
          f"(committed steps: {', '.join(map(str, committed)) if committed else 'none'})")


def read_manifest_or_fail(ckpt_dir: Path, dir_fd: int) -> Manifest:
    try:
        return read_manifest(ckpt_dir, dir_fd=dir_fd)
    except ManifestError as exc:
        fail(str(exc))
