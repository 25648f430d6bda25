"""Checkpoint retention: which checkpoint directories of a run to delete, and deleting them safely.

The decision (:func:`plan_prune`) is a pure function of step numbers and directory names, so it
is tested without a filesystem and shared by the checkpoint manager (coordinator, after each
commit) and ``slurmft ckpt prune``. The rules:

* keep the last ``keep_last`` committed steps, every step divisible by ``keep_every``, and every
  step in ``milestones``;
* never delete the newest *valid* checkpoint (the one a restart would load), even when the rules
  above would; with no valid checkpoint known, delete no committed checkpoint at all;
* never delete a checkpoint whose files a kept one references (an incremental save's ``refs``),
  transitively; a kept checkpoint whose references are unknown (its manifest unreadable for now,
  or of a newer format) keeps every older one; and while kept checkpoints reference older ones, keep the newest whole
  checkpoint older than all of those too (a fallback that shares no file with them);
* delete every ``step_N.tmp-<id>`` dir with ``N`` <= the newest committed step: a save of that
  step either committed already or can never become the newest. The manager runs retention
  between saves (at most one in flight), so no live save is ever a candidate.

Deleting a committed checkpoint first renames it to a tmp name (atomic), then removes the tree, so
a kill half-way leaves an abandoned tmp dir for the next pass, never a half-deleted ``step_N``
that looks committed. No torch here.

Root runs retention over users' run directories, so deletion never leaves the run's own
``checkpoints/``: that directory is opened once without following a link (a ``checkpoints``
that is a link is refused), every rename and removal is made relative to that descriptor, only
real directories are deleted (a link named like a checkpoint is reported and left alone), and
the tree removal itself never follows a link (``shutil.rmtree`` with ``dir_fd``). A caller that
has already opened ``checkpoints`` (``slurmft ckpt``, which opens the run dir once, and the
manager's pass after a commit) passes its descriptor as ``ckpt_fd``: the scan and the deletion
then act on that directory whatever its path names meanwhile.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from slurmft.rundir import RunDir, parse_step_dirname, step_dirname
from slurmft.safeio import UnsafeFileError, kind_of, open_dir
from slurmft.checkpoint.manifest import (ManifestError, ManifestUnreadable, ManifestVersionError, parse_tmp_dirname,
                                    read_manifest, tmp_dirname)


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 3
    keep_every: int | None = None
    milestones: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {self.keep_last!r}")
        if self.keep_every is not None and (
            isinstance(self.keep_every, bool) or not isinstance(self.keep_every, int) or self.keep_every < 1
        ):
            raise ValueError(f"keep_every must be an integer >= 1 or unset, got {self.keep_every!r}")
        bad = [m for m in self.milestones if isinstance(m, bool) or not isinstance(m, int) or m < 0]
        if bad:
            raise ValueError(f"milestones must be integers >= 0, got {bad[0]!r}")
        object.__setattr__(self, "milestones", frozenset(self.milestones))

    def protects(self, step: int) -> bool:
        """Whether ``keep_every`` or ``milestones`` keep ``step`` regardless of its age."""
        return step in self.milestones or (self.keep_every is not None and step % self.keep_every == 0)


@dataclass(frozen=True)
class PrunePlan:
    keep_steps: tuple[int, ...]
    delete_steps: tuple[int, ...]
    delete_tmp_dirs: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not self.delete_steps and not self.delete_tmp_dirs


def plan_prune(
    committed_steps: Iterable[int],
    newest_valid_step: int | None,
    tmp_dirs: Iterable[str],
    policy: RetentionPolicy,
    references: Mapping[int, frozenset[int] | None] | None = None,
) -> PrunePlan:
    """Decide what to delete; see the module docstring for the rules. ``references``: for each
    committed step, the steps whose files it references, or None where that is unknown
    (:func:`read_references`); a step missing from it references nothing."""
    steps = sorted(set(committed_steps))
    if newest_valid_step is not None and newest_valid_step not in steps:
        raise ValueError(f"newest valid step {newest_valid_step} is not among the committed steps")
    tmp_steps = {}
    for name in tmp_dirs:
        step = parse_tmp_dirname(name)
        if step is None:
            raise ValueError(f"{name!r} is not a checkpoint tmp dir name")
        tmp_steps[name] = step
    if newest_valid_step is None:
        keep = set(steps)
    else:
        keep = set(steps[-policy.keep_last:]) | {s for s in steps if policy.protects(s)}
        keep.add(newest_valid_step)
        keep = _with_references(keep, steps, references or {})
    newest_committed = steps[-1] if steps else None
    stale_tmp = sorted(n for n, s in tmp_steps.items() if newest_committed is not None and s <= newest_committed)
    return PrunePlan(
        keep_steps=tuple(sorted(keep)),
        delete_steps=tuple(s for s in steps if s not in keep),
        delete_tmp_dirs=tuple(stale_tmp),
    )


def _with_references(keep: set[int], steps: list[int],
                     refs: Mapping[int, frozenset[int] | None]) -> set[int]:
    """``keep`` plus everything its checkpoints reference, transitively (a kept checkpoint stays
    loadable), plus the newest whole checkpoint older than every referenced one: when a file that
    several incremental saves share is damaged, they all fail together, and that one does not."""

    def closure(start: set[int]) -> set[int]:
        done, todo = set(start), sorted(start)
        while todo:
            step = todo.pop()
            known = refs.get(step, frozenset())
            more = {s for s in steps if s < step} if known is None else set(known) & set(steps)
            todo += sorted(more - done)
            done |= more
        return done

    kept = closure(keep)
    referenced = {s for k in kept for s in (refs.get(k) or frozenset())} & set(steps)
    if referenced:
        whole = [s for s in steps if s < min(referenced) and refs.get(s, frozenset()) == frozenset()]
        if whole:
            kept = closure(kept | {whole[-1]})
    return kept


def read_references(ckpt_fd: int, steps: Iterable[int]) -> dict[int, frozenset[int] | None]:
    """What each committed checkpoint below the directory ``ckpt_fd`` references (its manifest's
    ``refs``). None where that is unknown but may matter: a manifest that could not be read this
    time (I/O, permissions) or is of a newer format (then nothing older may go). A checkpoint that
    can never load (manifest missing, malformed, a link or special file) references nothing."""
    out: dict[int, frozenset[int] | None] = {}
    for step in steps:
        name = step_dirname(step)
        try:
            fd = open_dir(name, dir_fd=ckpt_fd)
        except (FileNotFoundError, UnsafeFileError):
            continue  # gone since the scan, or no checkpoint directory: references nothing
        except OSError:
            out[step] = None
            continue
        try:
            out[step] = read_manifest(name, dir_fd=fd).referenced_steps
        except (ManifestUnreadable, ManifestVersionError):
            out[step] = None
        except ManifestError:
            out[step] = frozenset()
        finally:
            os.close(fd)
    return out


def scan_checkpoint_dirs(run_dir: str | os.PathLike[str], *,
                         ckpt_fd: int | None = None) -> tuple[list[int], list[str]]:
    """Committed steps (oldest first) and tmp dir names under ``<run_dir>/checkpoints`` (or the
    directory ``ckpt_fd``): real directories only. Raises :class:`slurmft.safeio.UnsafeFileError`
    when ``checkpoints`` is a link."""
    if ckpt_fd is not None:
        return _scan(ckpt_fd)
    try:
        root_fd = open_dir(RunDir(Path(run_dir)).checkpoints)
    except FileNotFoundError:
        return [], []
    try:
        return _scan(root_fd)
    finally:
        os.close(root_fd)


def _scan(root_fd: int) -> tuple[list[int], list[str]]:
    steps, tmp = [], []
    with os.scandir(root_fd) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            step = parse_step_dirname(entry.name)
            if step is not None:
                steps.append(step)
            elif parse_tmp_dirname(entry.name) is not None:
                tmp.append(entry.name)
    return sorted(steps), sorted(tmp)


def apply_prune(run_dir: str | os.PathLike[str], plan: PrunePlan,
                refused: Callable[[str], None] | None = None, *, ckpt_fd: int | None = None) -> list[Path]:
    """Delete what ``plan`` names under ``<run_dir>/checkpoints``; returns the paths removed.

    With ``ckpt_fd`` (a descriptor of that directory) the deletion happens there and ``run_dir``
    only names the paths reported. A directory that is already gone (another pruner got there
    first) is skipped silently. An entry that is not a real directory, or that cannot be removed,
    is left alone and reported to ``refused`` (one line naming it); the rest of the plan still
    runs. Raises :class:`slurmft.safeio.UnsafeFileError` (deleting nothing) when ``checkpoints``
    is a link.
    """
    root = RunDir(Path(run_dir)).checkpoints
    say = refused or (lambda _line: None)
    if ckpt_fd is not None:
        return _prune_below(ckpt_fd, root, plan, say)
    root_fd = open_dir(root)
    try:
        return _prune_below(root_fd, root, plan, say)
    finally:
        os.close(root_fd)


def _prune_below(root_fd: int, root: Path, plan: PrunePlan, say: Callable[[str], None]) -> list[Path]:
    removed: list[Path] = []
    for step in plan.delete_steps:
        name = step_dirname(step)
        if not _is_real_dir(root_fd, root, name, say):
            continue
        doomed = tmp_dirname(step, f"pruned-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(name, doomed, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            say(f"{root / name}: not deleted ({exc.strerror})")
            continue
        os.fsync(root_fd)
        if _rmtree(root_fd, root, doomed, say):
            removed.append(root / name)
    for name in plan.delete_tmp_dirs:
        if _is_real_dir(root_fd, root, name, say) and _rmtree(root_fd, root, name, say):
            removed.append(root / name)
    return removed


def _is_real_dir(root_fd: int, root: Path, name: str, say: Callable[[str], None]) -> bool:
    try:
        mode = os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(mode):
        return True
    say(f"{root / name}: {kind_of(mode)}, not a checkpoint directory; not deleted")
    return False


def _rmtree(root_fd: int, root: Path, name: str, say: Callable[[str], None]) -> bool:
    """Remove the tree ``name`` below ``root_fd`` without following links; entries vanishing
    underneath are fine, any other failure is reported and the tree left for the next pass."""

    def onerror(_func, _path, exc_info) -> None:
        if not issubclass(exc_info[0], FileNotFoundError):
            raise exc_info[1]

    try:
        shutil.rmtree(name, onerror=onerror, dir_fd=root_fd)
    except OSError as exc:
        say(f"{root / name}: not (fully) deleted ({exc.strerror or exc})")
        return False
    return True
