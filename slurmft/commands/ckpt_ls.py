"""What ``slurmft ckpt ls`` prints: the table and the JSON of a run's checkpoints, with the
node-local tiers that held each step; and the sizes and ages every ``slurmft ckpt`` command shows."""

from __future__ import annotations

import sys


from slurmft.rundir import RunDir
from slurmft.checkpoint.listing import CheckpointInfo
from slurmft.checkpoint.tiers import holders, read_tier_index
from slurmft.commands.ckpt_run import OpenRun, fail


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.2f} {unit}"


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


Holders = dict[int, tuple[str, ...]]  # step -> the nodes whose local tier held it
MAX_LOCAL_ROWS = 50  # local-only steps the table shows (the newest); a table row costs ~1 ms


def local_tiers(run: "OpenRun") -> Holders:
    """Which nodes' local tiers held which steps when the job last said (``ckpt_tiers.json``)."""
    try:
        return holders(read_tier_index(RunDir(run.root)))
    except ValueError as exc:
        print(f"warning: {exc}; node-local tiers not shown", file=sys.stderr)
        return {}


def local_only_steps(infos: list[CheckpointInfo], tiers: Holders) -> list[int]:
    in_run_dir = {i.step for i in infos if i.committed}
    return sorted(set(tiers) - in_run_dir)


def info_json(info: CheckpointInfo, now: float, tiers: Holders | None = None) -> dict:
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


def fail_if_newer_format(infos: list[CheckpointInfo], consequence: str = "") -> None:
    """Exit 2 naming the first checkpoint whose manifest a newer slurmft wrote."""
    newer = [i for i in infos if i.newer_format]
    if newer:
        more = f" (and {len(newer) - 1} more)" if len(newer) > 1 else ""
        fail(f"{newer[0].error}{more}{consequence}")


def print_ls_table(run: OpenRun, infos: list[CheckpointInfo], now: float,
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
        table.add_row(str(info.step), info.name, state, human_bytes(info.size_bytes), files, refs or "-",
                      where, human_age(now - info.mtime), manifest)
    local_only = local_only_steps(infos, tiers)
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
