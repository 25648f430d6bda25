"""``slurmft ckpt``: list, verify, prune, inspect and export the checkpoints of one run directory.

Works on a login node without torch: ``ls``, ``verify``, ``prune`` and ``inspect`` use only the
torch-free :mod:`slurmft.checkpoint.manifest` and :mod:`slurmft.checkpoint.retention`. Only ``export`` and
``inspect --tensors`` import torch, lazily, through :mod:`slurmft.checkpoint.export`.

A checkpoint is named by its step (``1200``) or its directory name (``step_000001200``). An
in-flight or abandoned ``step_N.tmp-<id>`` directory is never a valid choice: it is not a
checkpoint until it has been renamed. Exit codes:

  0  done; every checkpoint checked is intact
  1  a checkpoint failed verification (each problem printed, one line per file)
  2  bad input: not a run directory, a run directory that is a link, no such checkpoint, a tmp
     dir, an unreadable manifest, a bad ``[checkpoint]`` setting, a ``checkpoints`` that is a
     link, a ``.metadata`` the allow-list unpickler refuses, an entry ``prune`` refused to delete
     (a link named like a checkpoint), any file system error; or a manifest written by a newer slurmft (upgrade slurmft): such a
     checkpoint is not called corrupt, and ``prune`` deletes nothing while one is present

The run directory is untrusted input (its owner writes it; root may run these): it is opened once,
not through a link, and everything after is looked up relative to that descriptor, never by its
path again (its owner may swap the path for a link to another run meanwhile); no link is
followed below it, only regular files are read, and DCP's ``.metadata`` is unpickled only through
an allow-list (``docs/security.md``). Entries of ``checkpoints/`` that are no checkpoint (a link,
a special file, a non-canonical step name) are named on stderr and ignored.

``prune`` applies the retention policy of the ``[checkpoint]`` section that the training job reads
(slurmft.toml, ``SLURMFT_CHECKPOINT_*``); its flags override single settings.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Optional, ParamSpec, TypeVar

import typer

from slurmft import numbers
from slurmft.config import ConfigError, find_config_file
from slurmft.rundir import CHECKPOINTS, STEP_PREFIX, RunDir, parse_step_dirname, step_dirname
from slurmft.safeio import UnsafeFileError, kind_of, lstat_at, open_dir
from slurmft.checkpoint.config import CheckpointConfig
from slurmft.checkpoint.listing import CheckpointInfo, list_checkpoints, stray_entries
from slurmft.checkpoint.tiers import holders, read_tier_index
from slurmft.checkpoint.manifest import (MANIFEST_NAME, Manifest, ManifestError, ManifestVersionError, VerifyReport,
                                    parse_tmp_dirname, read_manifest, unopened_report, verify_checkpoint)
from slurmft.checkpoint.retention import (RetentionPolicy, apply_prune, plan_prune, read_references,
                                     scan_checkpoint_dirs)

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE = 0, 1, 2
PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar when verifying more than this

app = typer.Typer(
    name="ckpt",
    help="List, verify, prune, inspect and export a run's checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

RunDirArg = typer.Argument(..., help="The run directory (the one holding checkpoints/).", show_default=False)


def _fail(message: str) -> NoReturn:
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
            _fail(f"{where}{exc.strerror or exc}")
        except (RecursionError, ValueError) as exc:
            _fail(f"bad input: {' '.join(str(exc).split())[:300]}")

    return wrapper


def _warn_strays(run: OpenRun) -> None:
    for line in stray_entries(run.root, ckpt_fd=run.ckpt_fd):
        print(f"slurmft ckpt: {line}", file=sys.stderr)


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.2f} {unit}"


def _human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


# ----------------------------------------------------------------------------- argument checks


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
        _fail(f"{path}: no such directory")
    except UnsafeFileError as exc:
        if exc.what.startswith("a symbolic link"):
            _fail(f"{path}: a symbolic link; name the run directory itself, not a link to it (not followed)")
        _fail(f"{path}: not a directory")
    except NotADirectoryError:
        _fail(f"{path}: not a directory")
    except OSError as exc:
        _fail(f"{path}: {exc.strerror}")
    try:
        return OpenRun(Path(path), _open_checkpoints(Path(path), run_fd))
    finally:
        os.close(run_fd)


def _open_checkpoints(path: Path, run_fd: int) -> int:
    """A descriptor of ``checkpoints/`` below the run dir ``run_fd`` (``path`` names it)."""
    name = path.name
    if lstat_at(MANIFEST_NAME, run_fd) is not None or parse_step_dirname(name) is not None \
            or parse_tmp_dirname(name) is not None:
        _fail(f"{path} is a checkpoint directory; pass its run directory ({path.parent.parent})")
    checkpoints = RunDir(path).checkpoints
    try:
        return open_dir(CHECKPOINTS, dir_fd=run_fd, shown=checkpoints)
    except UnsafeFileError as exc:
        if exc.what.startswith("a symbolic link"):
            _fail(f"{checkpoints}: a symbolic link; a run's checkpoints must be a real directory inside it "
                  f"(not followed)")
        _fail(f"{path} is not a slurmft run directory (no {CHECKPOINTS}/ inside)")
    except (FileNotFoundError, NotADirectoryError):
        _fail(f"{path} is not a slurmft run directory (no {CHECKPOINTS}/ inside)")


def resolve_checkpoint(run: OpenRun, selector: str) -> Path:
    """The committed checkpoint named by ``selector`` (a step number or a ``step_N`` dir name)."""
    name = Path(selector).name
    tmp_step = parse_tmp_dirname(name)
    if tmp_step is not None:
        _fail(f"{name} is an in-flight or abandoned checkpoint (a .tmp- directory), never loaded; "
              f"name a committed step (see 'slurmft ckpt ls')")
    step: int | None
    if name.isascii() and name.isdigit() and len(name) <= 20:
        step = int(name)
    else:
        step = parse_step_dirname(name)
        if step is None:
            shown = selector if len(selector) <= 60 else f"{selector[:40]}...({len(selector)} characters)"
            _fail(f"{shown!r} is not a step number or a {STEP_PREFIX}N directory name")
    path = run.checkpoint(step)
    found = lstat_at(path.name, run.ckpt_fd)
    if found is not None:
        if stat.S_ISDIR(found.st_mode):
            return path
        _fail(f"{path}: {kind_of(found.st_mode)}, not a checkpoint directory (not followed)")
    committed, tmp_dirs = scan_checkpoint_dirs(run.root, ckpt_fd=run.ckpt_fd)
    pending = [n for n in tmp_dirs if parse_tmp_dirname(n) == step]
    if pending:
        _fail(f"step {step} was never committed (only {', '.join(pending)}: in flight or abandoned)")
    _fail(f"no checkpoint for step {step} in {run.checkpoints} "
          f"(committed steps: {', '.join(map(str, committed)) if committed else 'none'})")


def _read_manifest_or_fail(ckpt_dir: Path, dir_fd: int) -> Manifest:
    try:
        return read_manifest(ckpt_dir, dir_fd=dir_fd)
    except ManifestError as exc:
        _fail(str(exc))


# ----------------------------------------------------------------------------- ls


Holders = dict[int, tuple[str, ...]]  # step -> the nodes whose local tier held it
MAX_LOCAL_ROWS = 50  # local-only steps the table shows (the newest); a table row costs ~1 ms


def _local_tiers(run: "OpenRun") -> Holders:
    """Which nodes' local tiers held which steps when the job last said (``ckpt_tiers.json``)."""
    try:
        return holders(read_tier_index(RunDir(run.root)))
    except ValueError as exc:
        print(f"warning: {exc}; node-local tiers not shown", file=sys.stderr)
        return {}


def _local_only(infos: list[CheckpointInfo], tiers: Holders) -> list[int]:
    in_run_dir = {i.step for i in infos if i.committed}
    return sorted(set(tiers) - in_run_dir)


def _info_json(info: CheckpointInfo, now: float, tiers: Holders | None = None) -> dict:
    m = info.manifest
    return {
        "local_nodes": list((tiers or {}).get(info.step, ())) if info.committed else [],
        "name": info.name, "path": str(info.path), "step": info.step, "committed": info.committed,
        "size_bytes": info.size_bytes, "age_s": round(now - info.mtime, 3),
        "files": len(m.files) if m else None, "world_size": m.world_size if m else None,
        "created_at": m.created_at if m else None, "manifest_ok": m is not None and info.error is None,
        "references": sorted(m.referenced_steps) if m else None,
        "error": info.error, "newer_format": info.newer_format,
    }


@app.command("ls")
@bad_input_is_usage
def ls(
    run_dir: Path = RunDirArg,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List committed and in-flight/abandoned checkpoints (manifests read, checksums not)."""
    with open_run_dir(run_dir) as run:
        infos = list_checkpoints(run.root, ckpt_fd=run.ckpt_fd)
        _warn_strays(run)
        tiers = _local_tiers(run)
    now = time.time()
    if as_json:
        print(numbers.dumps({"run_dir": str(run.root), "checkpoints": [_info_json(i, now, tiers) for i in infos],
                          "local_only": [{"step": s, "local_nodes": list(tiers[s])}
                                         for s in _local_only(infos, tiers)]}, indent=2))
    else:
        _print_ls_table(run, infos, now, tiers)
    _fail_if_newer_format(infos)


def _fail_if_newer_format(infos: list[CheckpointInfo], consequence: str = "") -> None:
    """Exit 2 naming the first checkpoint whose manifest a newer slurmft wrote."""
    newer = [i for i in infos if i.newer_format]
    if newer:
        more = f" (and {len(newer) - 1} more)" if len(newer) > 1 else ""
        _fail(f"{newer[0].error}{more}{consequence}")


def _print_ls_table(run: OpenRun, infos: list[CheckpointInfo], now: float,
                    tiers: Holders) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoints in {run.checkpoints}",
                  caption="tmp: in flight or abandoned. refs: steps whose files an incremental save "
                          "references. tiers: run dir, and the nodes whose local tier held the step "
                          "when the job last recorded it. Manifests read, checksums not: see 'verify'.")
    for column in ("step", "directory", "state", "size", "files", "refs", "tiers", "age", "manifest"):
        table.add_column(column, justify="right" if column in ("step", "size", "files", "age") else "left",
                         no_wrap=column != "manifest")
    for info in infos:
        state = "committed" if info.committed else "[yellow]tmp[/]"
        if info.newer_format:
            manifest = "[yellow]written by a newer slurmft: upgrade slurmft[/]"
        elif info.error:
            manifest = f"[red]{info.error}[/]"
        else:
            manifest = "ok" if info.manifest else "-"
        files = str(len(info.manifest.files)) if info.manifest else "-"
        refs = ",".join(map(str, sorted(info.manifest.referenced_steps))) if info.manifest else ""
        local = tiers.get(info.step, ()) if info.committed else ()
        where = ("run dir" + (f" + local ({','.join(local)})" if local else "")) if info.committed else "-"
        table.add_row(str(info.step), info.name, state, _human_bytes(info.size_bytes), files, refs or "-",
                      where, _human_age(now - info.mtime), manifest)
    local_only = _local_only(infos, tiers)
    for step in local_only[-MAX_LOCAL_ROWS:]:
        table.add_row(str(step), "-", "[cyan]local only[/]", "-", "-", "-",
                      f"local ({','.join(tiers[step])})", "-",
                      "on the nodes' local disks: not verifiable from here")
    if len(local_only) > MAX_LOCAL_ROWS:
        table.add_row("...", "-", "[cyan]local only[/]", "-", "-", "-", "-", "-",
                      f"{len(local_only) - MAX_LOCAL_ROWS} older local-only steps not shown "
                      f"(from {local_only[0]}); --json lists them all")
    console = Console()
    if infos or local_only:
        console.print(table)
    else:
        console.print(f"no checkpoints in {run.checkpoints}")


# ----------------------------------------------------------------------------- verify


def verify_in(run: OpenRun, ckpt_dir: Path, *, quiet: bool = False) -> VerifyReport:
    """:func:`verify_with_progress` of the checkpoint ``ckpt_dir`` names, opened below the run's
    descriptor; one that cannot be opened (gone, swapped for a link) is a failed report."""
    try:
        dir_fd = run.open_checkpoint(ckpt_dir)
    except OSError as exc:
        return unopened_report(ckpt_dir, exc)
    try:
        return verify_with_progress(ckpt_dir, dir_fd, quiet=quiet)
    finally:
        os.close(dir_fd)


def verify_with_progress(ckpt_dir: Path, dir_fd: int, *, quiet: bool = False) -> VerifyReport:
    """Full checksum verification of the checkpoint dir ``dir_fd`` (``ckpt_dir`` names it); a
    progress bar on stderr for checkpoints above PROGRESS_MIN_BYTES."""
    try:
        total = sum(f.size for f in read_manifest(ckpt_dir, dir_fd=dir_fd).every_file)
    except ManifestError:
        total = 0  # verify_checkpoint reports the manifest problem itself
    if quiet or total < PROGRESS_MIN_BYTES:
        return verify_checkpoint(ckpt_dir, dir_fd=dir_fd)
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("verify {task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                  transient=True) as bar:
        task = bar.add_task(ckpt_dir.name, total=total)
        return verify_checkpoint(ckpt_dir, progress=lambda done, _total: bar.update(task, completed=done),
                                 dir_fd=dir_fd)


@app.command("verify")
@bad_input_is_usage
def verify(
    run_dir: Path = RunDirArg,
    step: Optional[str] = typer.Argument(None, help="Step or step_N directory (default: the newest).",
                                         show_default=False),
    all_: bool = typer.Option(False, "--all", help="Verify every committed checkpoint."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Recompute every file's checksum against the manifest; exit 1 naming each problem."""
    with open_run_dir(run_dir) as run:
        results = _verify_run(run, step, all_, as_json)
    bad = [r for r, _ in results if not r.ok]
    if as_json:
        print(numbers.dumps({"ok": not bad, "checkpoints": [
            {"path": str(r.ckpt_dir), "step": r.manifest.step if r.manifest else None, "ok": r.ok,
             "problems": list(r.problems), "bytes_checked": r.bytes_checked, "seconds": round(s, 3)}
            for r, s in results]}, indent=2))
    else:
        for report, seconds in results:
            if report.ok and report.manifest is not None:  # ok: the manifest was read
                rate = report.bytes_checked / seconds / 1e9 if seconds > 0 else 0.0
                refs = len(report.manifest.refs)
                also = f" + {refs} referenced in step(s) {', '.join(map(str, sorted(report.manifest.referenced_steps)))}" if refs else ""
                print(f"{report.ckpt_dir.name}: ok, {len(report.manifest.files)} files{also}, "
                      f"{_human_bytes(report.bytes_checked)} checked in {seconds:.2f} s ({rate:.2f} GB/s)")
            else:
                print(f"{report.ckpt_dir.name}: CORRUPT, {len(report.problems)} problem(s):")
                for problem in report.problems:
                    print(f"  {problem}")
    if bad:
        raise typer.Exit(EXIT_CORRUPT)


def _verify_run(run: OpenRun, step: Optional[str], all_: bool, quiet: bool) -> list[tuple[VerifyReport, float]]:
    _warn_strays(run)
    if all_ and step is not None:
        _fail("give a STEP or --all, not both")
    if step is not None:
        targets = [resolve_checkpoint(run, step)]
    else:
        steps = run.committed_steps()
        if not steps:
            _fail(f"no committed checkpoint in {run.checkpoints}")
        targets = [run.checkpoint(s) for s in (steps if all_ else steps[-1:])]
    results = []
    for path in targets:
        started = time.perf_counter()
        try:
            report = verify_in(run, path, quiet=quiet)
        except ManifestVersionError as exc:
            _fail(str(exc))
        results.append((report, time.perf_counter() - started))
    return results


# ----------------------------------------------------------------------------- prune


def newest_valid_step(run: OpenRun, steps: list[int], *, say=print) -> int | None:
    """Verify committed checkpoints newest first; the first that passes, or None."""
    for step in reversed(steps):
        report = verify_in(run, run.checkpoint(step))
        if report.ok:
            return step
        say(f"{step_dirname(step)} fails verification ({report.problems[0]}); trying the one before")
    return None


def retention_policy(config: Optional[Path], keep_last: Optional[int], keep_every: Optional[int],
                     milestones: Optional[list[int]]) -> tuple[RetentionPolicy, Optional[Path]]:
    """The job's ``[checkpoint]`` retention with the given flags on top, and the config file read."""
    try:
        source = find_config_file(config)
        settings = CheckpointConfig.load(source, keep_last=keep_last, keep_every=keep_every,
                                         milestones=tuple(milestones) if milestones else None)
    except ConfigError as exc:
        _fail(str(exc))
    return settings.retention(), source


def _describe_policy(policy: RetentionPolicy) -> str:
    every = f"every step divisible by {policy.keep_every}" if policy.keep_every else "no keep-every"
    marks = ", ".join(map(str, sorted(policy.milestones))) or "none"
    return f"keep the last {policy.keep_last}, {every}, milestones: {marks}"


@app.command("prune")
@bad_input_is_usage
def prune(
    run_dir: Path = RunDirArg,
    keep_last: Optional[int] = typer.Option(None, "--keep-last", show_default=False,
                                            help="Keep the newest K checkpoints (overrides keep_last)."),
    keep_every: Optional[int] = typer.Option(None, "--keep-every", show_default=False,
                                             help="Also keep every step divisible by M (overrides keep_every)."),
    milestones: Optional[list[int]] = typer.Option(None, "--milestone", show_default=False,
                                                   help="Keep this step (repeatable; replaces milestones)."),
    config: Optional[Path] = typer.Option(None, "--config", show_default=False,
                                          help="slurmft.toml to read \\[checkpoint] from "
                                               "(default: $SLURMFT_CONFIG, else ./slurmft.toml)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; delete nothing."),
) -> None:
    """Delete checkpoints outside the retention policy, never the newest valid one, and stale tmp dirs.

    The policy is the job's: [checkpoint] keep_last / keep_every / milestones from slurmft.toml and
    SLURMFT_CHECKPOINT_*, each overridden by its flag. The newest valid checkpoint is found by full
    verification, newest first. Nothing is deleted while a checkpoint from a newer slurmft is present.
    """
    with open_run_dir(run_dir) as run:
        _warn_strays(run)
        policy, source = retention_policy(config, keep_last, keep_every, milestones)
        _prune_run(run, policy, source, dry_run)


def _prune_run(run: OpenRun, policy: RetentionPolicy, source: Optional[Path], dry_run: bool) -> None:
    _fail_if_newer_format(list_checkpoints(run.root, ckpt_fd=run.ckpt_fd), "; nothing pruned")
    print(f"retention: {_describe_policy(policy)} (config file: {source or 'none'})")
    committed, tmp_dirs = scan_checkpoint_dirs(run.root, ckpt_fd=run.ckpt_fd)
    try:
        valid = newest_valid_step(run, committed)
    except ManifestVersionError as exc:  # a newer slurmft committed one since the check above
        _fail(f"{exc}; nothing pruned")
    if committed and valid is None:
        print("no committed checkpoint verifies: keeping every committed checkpoint")
    plan = plan_prune(committed, valid, tmp_dirs, policy, read_references(run.ckpt_fd, committed))
    for step in plan.keep_steps:
        note = " (newest valid)" if step == valid else ""
        print(f"keep   {step_dirname(step)}{note}")
    for step in plan.delete_steps:
        print(f"delete {step_dirname(step)}")
    for name in plan.delete_tmp_dirs:
        print(f"delete {name} (abandoned)")
    if plan.empty:
        print("nothing to delete")
    elif dry_run:
        print("dry run: nothing deleted")
    else:
        refused: list[str] = []
        removed = apply_prune(run.root, plan, refused.append, ckpt_fd=run.ckpt_fd)  # the directory verified
        print(f"deleted {len(removed)} director{'y' if len(removed) == 1 else 'ies'}")
        if refused:
            _fail("; ".join(refused))


# ----------------------------------------------------------------------------- inspect


@app.command("inspect")
@bad_input_is_usage
def inspect(
    run_dir: Path = RunDirArg,
    step: str = typer.Argument(..., help="Step or step_N directory.", show_default=False),
    tensors: bool = typer.Option(False, "--tensors",
                                 help="Also list the saved tensors from DCP's .metadata (imports torch)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Print a checkpoint's manifest and files; with --tensors, every tensor's dtype and shape."""
    with open_run_dir(run_dir) as run:
        path = resolve_checkpoint(run, step)
        with run.opened(path) as dir_fd:
            manifest = _read_manifest_or_fail(path, dir_fd)
            described = _describe_tensors(path, dir_fd, manifest) if tensors else None
    if as_json:
        out = {"path": str(path), "manifest": manifest.to_json()}
        if described is not None:
            out["tensors"] = [t.to_json() for t in described]
        print(numbers.dumps(out, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    created = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(manifest.created_at))
    for key, value in (("checkpoint", path), ("step", manifest.step), ("world size", manifest.world_size),
                       ("created", created), ("torch", manifest.torch_version),
                       ("job id", manifest.job_id or "-"),
                       ("restart count", "-" if manifest.restart_count is None else manifest.restart_count),
                       ("format", manifest.format_version), ("checksum", manifest.hash_algo),
                       ("size", _human_bytes(manifest.total_bytes))):
        console.print(f"{key:>14}: {value}", highlight=False)
    if manifest.extra:
        console.print(f"{'extra':>14}: {json.dumps(manifest.extra, sort_keys=True)}", highlight=False)
    files = Table(title="files (../step_N/...: referenced, held by an older checkpoint)" if manifest.refs else "files")
    for column in ("path", "size", manifest.hash_algo):
        files.add_column(column, justify="right" if column == "size" else "left")
    for f in manifest.every_file:
        files.add_row(f.path, _human_bytes(f.size), f.hash)
    console.print(files)
    if described is not None:
        table = Table(title="tensors (from DCP .metadata)")
        for column in ("key", "dtype", "shape", "size", "chunks"):
            table.add_column(column, justify="right" if column in ("size", "chunks") else "left")
        for t in described:
            shape = "-" if t.dtype == "bytes" else ("x".join(map(str, t.shape)) or "scalar")
            table.add_row(t.key, t.dtype, shape,
                          _human_bytes(t.nbytes) if t.nbytes is not None else "-",
                          str(t.chunks) if t.chunks is not None else "-")
        console.print(table)


def _describe_tensors(path: Path, dir_fd: int, manifest: Manifest):  # -> list[TensorInfo]
    from slurmft.checkpoint.export import ExportError, describe_checkpoint

    try:
        return describe_checkpoint(path, manifest, dir_fd=dir_fd)
    except ExportError as exc:
        _fail(str(exc))


# ----------------------------------------------------------------------------- export


@app.command("export")
@bad_input_is_usage
def export(
    run_dir: Path = RunDirArg,
    step: str = typer.Argument(..., help="Step or step_N directory.", show_default=False),
    out: Path = typer.Argument(..., help="Output file, ending in .safetensors.", show_default=False),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT if it exists."),
) -> None:
    """Write the model weights of a checkpoint, consolidated from any world size, as safetensors.

    The checkpoint is fully verified first; the output appears atomically (temp file + rename).
    """
    with open_run_dir(run_dir) as run:
        path = resolve_checkpoint(run, step)
        with run.opened(path) as dir_fd:  # verified and read through this one descriptor
            _export(path, dir_fd, out, force)


def _export(path: Path, dir_fd: int, out: Path, force: bool) -> None:
    manifest = _read_manifest_or_fail(path, dir_fd)
    if out.suffix != ".safetensors":
        _fail(f"{out}: the output file name must end in .safetensors")
    if out.exists() and not force:
        _fail(f"{out} exists; pass --force to overwrite it")
    if out.exists() and not out.is_file():
        _fail(f"{out} exists and is not a regular file")
    if not out.parent.is_dir():
        _fail(f"{out.parent}: no such directory for the output")
    report = verify_with_progress(path, dir_fd)
    if not report.ok:
        print(f"{path.name}: CORRUPT, not exported:", file=sys.stderr)
        for problem in report.problems:
            print(f"  {problem}", file=sys.stderr)
        raise typer.Exit(EXIT_CORRUPT)
    from slurmft.checkpoint.export import ExportError, export_model_safetensors

    try:
        summary = export_model_safetensors(path, manifest, out, dir_fd=dir_fd)
    except ExportError as exc:
        _fail(str(exc))
    print(f"wrote {out}: {summary.tensors} tensors, {_human_bytes(summary.nbytes)} "
          f"(model weights of step {manifest.step}, saved by {manifest.world_size} rank(s))")
