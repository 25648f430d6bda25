"""``slurmft sweep``: health-check this node, drain or resume it through Slurm, report.

Run as root on each compute node (cron via ``bin/slurmft-sweep-cron``, or Slurm's
HealthCheckProgram via ``bin/slurmft-healthcheck``). The command's options as typer reads them;
what it does, and its exit codes, are ``slurmft.sweep.main``'s (also ``python -m
slurmft.sweep.main``, the pre-flight's way in).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from slurmft.sweep.main import HELP, run


def app(
    node: Optional[str] = typer.Option(None, "--node", help=HELP["--node"]),
    config: Optional[Path] = typer.Option(None, "--config", help=HELP["--config"]),
    quick: bool = typer.Option(False, "--quick", help=HELP["--quick"]),
    deep: bool = typer.Option(False, "--deep", help=HELP["--deep"]),
    dry_run: bool = typer.Option(False, "--dry-run", help=HELP["--dry-run"]),
    as_json: bool = typer.Option(False, "--json", help=HELP["--json"]),
    forget_xids: bool = typer.Option(False, "--forget-xids", help=HELP["--forget-xids"]),
) -> None:
    """Health-check this node; drain it on failure, resume only slurmft's own drains."""
    raise typer.Exit(run(node, config, quick, deep, dry_run, as_json, forget_xids))
