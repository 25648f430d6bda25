"""``slurmft ckpt``: list, verify, prune, inspect and export the checkpoints of one run directory.

Works on a login node without torch: ``ls``, ``verify``, ``prune`` and ``inspect`` use only the
torch-free :mod:`slurmft.checkpoint.manifest`, :mod:`slurmft.checkpoint.verify` and
:mod:`slurmft.checkpoint.retention`. Only ``export`` and
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

This module holds the commands; opening the run directory and resolving a checkpoint are
:mod:`slurmft.commands.ckpt_run`, the listing ``ls`` prints :mod:`slurmft.commands.ckpt_ls`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from slurmft import numbers
from slurmft.config import ConfigError, find_config_file
from slurmft.rundir import step_dirname
from slurmft.checkpoint.config import CheckpointConfig
from slurmft.checkpoint.listing import list_checkpoints
from slurmft.checkpoint.manifest import Manifest, ManifestError, ManifestVersionError, read_manifest
from slurmft.checkpoint.verify import VerifyReport, unopened_report, verify_checkpoint
from slurmft.checkpoint.retention import (RetentionPolicy, apply_prune, plan_prune, read_references,
                                     scan_checkpoint_dirs)
from slurmft.commands.ckpt_run import (EXIT_CORRUPT, OpenRun, bad_input_is_usage, fail,
                                       open_run_dir, read_manifest_or_fail, resolve_checkpoint, warn_strays)
from slurmft.commands.ckpt_ls import (fail_if_newer_format, human_bytes, info_json, local_only_steps, local_tiers,
                                      print_ls_table)

PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar when verifying more than this

app = typer.Typer(
    name="ckpt",
    help="List, verify, prune, inspect and export a run's checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

RunDirArg = typer.Argument(..., help="The run directory (the one holding checkpoints/).", show_default=False)


# ----------------------------------------------------------------------------- ls


@app.command("ls")
@bad_input_is_usage
def ls(
    run_dir: Path = RunDirArg,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List committed and in-flight/abandoned checkpoints (manifests read, checksums not)."""
    with open_run_dir(run_dir) as run:
        infos = list_checkpoints(run.root, ckpt_fd=run.ckpt_fd)
        warn_strays(run)
        tiers = local_tiers(run)
    now = time.time()
    if as_json:
        print(numbers.dumps({"run_dir": str(run.root), "checkpoints": [info_json(i, now, tiers) for i in infos],
                          "local_only": [{"step": s, "local_nodes": list(tiers[s])}
                                         for s in local_only_steps(infos, tiers)]}, indent=2))
    else:
        print_ls_table(run, infos, now, tiers)
    fail_if_newer_format(infos)


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
                      f"{human_bytes(report.bytes_checked)} checked in {seconds:.2f} s ({rate:.2f} GB/s)")
            else:
                print(f"{report.ckpt_dir.name}: CORRUPT, {len(report.problems)} problem(s):")
                for problem in report.problems:
                    print(f"  {problem}")
    if bad:
        raise typer.Exit(EXIT_CORRUPT)


def _verify_run(run: OpenRun, step: Optional[str], all_: bool, quiet: bool) -> list[tuple[VerifyReport, float]]:
    warn_strays(run)
    if all_ and step is not None:
        fail("give a STEP or --all, not both")
    if step is not None:
        targets = [resolve_checkpoint(run, step)]
    else:
        steps = run.committed_steps()
        if not steps:
            fail(f"no committed checkpoint in {run.checkpoints}")
        targets = [run.checkpoint(s) for s in (steps if all_ else steps[-1:])]
    results = []
    for path in targets:
        started = time.perf_counter()
        try:
            report = verify_in(run, path, quiet=quiet)
        except ManifestVersionError as exc:
            fail(str(exc))
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
        fail(str(exc))
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
        warn_strays(run)
        policy, source = retention_policy(config, keep_last, keep_every, milestones)
        _prune_run(run, policy, source, dry_run)


def _prune_run(run: OpenRun, policy: RetentionPolicy, source: Optional[Path], dry_run: bool) -> None:
    fail_if_newer_format(list_checkpoints(run.root, ckpt_fd=run.ckpt_fd), "; nothing pruned")
    print(f"retention: {_describe_policy(policy)} (config file: {source or 'none'})")
    committed, tmp_dirs = scan_checkpoint_dirs(run.root, ckpt_fd=run.ckpt_fd)
    try:
        valid = newest_valid_step(run, committed)
    except ManifestVersionError as exc:  # a newer slurmft committed one since the check above
        fail(f"{exc}; nothing pruned")
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
            fail("; ".join(refused))


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
            manifest = read_manifest_or_fail(path, dir_fd)
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
                       ("size", human_bytes(manifest.total_bytes))):
        console.print(f"{key:>14}: {value}", highlight=False)
    if manifest.extra:
        console.print(f"{'extra':>14}: {json.dumps(manifest.extra, sort_keys=True)}", highlight=False)
    files = Table(title="files (../step_N/...: referenced, held by an older checkpoint)" if manifest.refs else "files")
    for column in ("path", "size", manifest.hash_algo):
        files.add_column(column, justify="right" if column == "size" else "left")
    for f in manifest.every_file:
        files.add_row(f.path, human_bytes(f.size), f.hash)
    console.print(files)
    if described is not None:
        table = Table(title="tensors (from DCP .metadata)")
        for column in ("key", "dtype", "shape", "size", "chunks"):
            table.add_column(column, justify="right" if column in ("size", "chunks") else "left")
        for t in described:
            shape = "-" if t.dtype == "bytes" else ("x".join(map(str, t.shape)) or "scalar")
            table.add_row(t.key, t.dtype, shape,
                          human_bytes(t.nbytes) if t.nbytes is not None else "-",
                          str(t.chunks) if t.chunks is not None else "-")
        console.print(table)


def _describe_tensors(path: Path, dir_fd: int, manifest: Manifest):  # -> list[TensorInfo]
    from slurmft.checkpoint.export import ExportError, describe_checkpoint

    try:
        return describe_checkpoint(path, manifest, dir_fd=dir_fd)
    except ExportError as exc:
        fail(str(exc))


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
    manifest = read_manifest_or_fail(path, dir_fd)
    if out.suffix != ".safetensors":
        fail(f"{out}: the output file name must end in .safetensors")
    if out.exists() and not force:
        fail(f"{out} exists; pass --force to overwrite it")
    if out.exists() and not out.is_file():
        fail(f"{out} exists and is not a regular file")
    if not out.parent.is_dir():
        fail(f"{out.parent}: no such directory for the output")
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
        fail(str(exc))
    print(f"wrote {out}: {summary.tensors} tensors, {human_bytes(summary.nbytes)} "
          f"(model weights of step {manifest.step}, saved by {manifest.world_size} rank(s))")
