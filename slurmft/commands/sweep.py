"""``slurmft sweep``: health-check this node, drain or resume it through Slurm, report.

Run as root on each compute node (cron via ``bin/slurmft-sweep-cron``, or Slurm's
HealthCheckProgram via ``bin/slurmft-healthcheck``). Exit codes:

  0  healthy (warnings and skipped checks allowed)
  1  unhealthy, or not proven healthy: a check failed (drained, already drained, or the guard
     refused or withdrew the drain), or slurmft's drain is kept because a check behind it
     could not run
  2  usage or configuration error (nothing gathered, drained or resumed)
  3  another sweep for this node is running (nothing done)
  4  a Slurm call failed: the nodes could not be read, or a drain/resume (or the guard's re-read
     after a drain) failed; what was done is on the log line (``acted=``) and in the report
  5  the sweep ran and acted as its log line says, but writing its state, report or metrics
     textfile failed (``write_errors=``)
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Optional

import typer

from slurmft import numbers
from slurmft.config import ConfigError, load_section

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_USAGE, EXIT_LOCKED, EXIT_SLURM, EXIT_WRITE = 0, 1, 2, 3, 4, 5


def default_node_name() -> str:
    """Slurm's name for this node: $SLURMD_NODENAME (set for Slurm's hooks), else the short hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".", 1)[0]


def _log(message: str) -> None:
    # syslog-friendly: one line, "slurmft-sweep: key=value ..." on stderr
    print(f"slurmft-sweep: {message}", file=sys.stderr, flush=True)


def _client(config_file: Optional[Path]):  # -> SlurmClient
    from slurmft.slurm.cli import CliSlurmClient
    from slurmft.slurm.config import SlurmConfig

    return CliSlurmClient(load_section(SlurmConfig, "slurm", config_file=config_file))


def _print_table(report) -> None:  # report: SweepReport
    from rich.console import Console
    from rich.table import Table

    colour = {"ok": "green", "warn": "yellow", "fail": "red", "skipped": "dim"}
    table = Table(title=f"slurmft sweep {report.node} ({report.mode}{', dry run' if report.dry_run else ''})")
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    for r in report.results:
        table.add_row(r.check, f"[{colour[r.status.value]}]{r.status.value}[/]", r.detail)
    console = Console()
    console.print(table)
    d = report.decision
    if d is None:
        console.print(f"decision: none ({report.slurm_error})")
    else:
        acted = report.outcome.acted or ("nothing (dry run)" if report.dry_run else "nothing")
        console.print(f"decision: {d.action.value} — {d.why}" + (f"\nreason: {d.reason}" if d.reason else ""))
        console.print(f"acted: {acted}" + (f" ({report.outcome.detail})" if report.outcome.detail else "")
                      + (f"  error: {report.outcome.error}" if report.outcome.error else ""))
    for error in report.write_errors:
        console.print(f"write failed: {error}")
    for note in report.notes:
        console.print(f"note: {note}")


def app(
    node: Optional[str] = typer.Option(None, "--node", help="Slurm node name (default: this host's)."),
    config: Optional[Path] = typer.Option(None, "--config", help="slurmft.toml to read."),
    quick: bool = typer.Option(False, "--quick", help="Cheap checks only (the sbatch pre-flight)."),
    deep: bool = typer.Option(False, "--deep", help="Also run slow diagnostics (dcgmi diag -r 1)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Decide and print; drain, resume and write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    forget_xids: bool = typer.Option(False, "--forget-xids",
                                     help="Forget remembered drain-level Xids (after a GPU reset)."),
) -> None:
    """Health-check this node; drain it on failure, resume only slurmft's own drains."""
    from slurmft.health.registry import Mode, load_health_config
    from slurmft.slurm.client import InvalidArgument
    from slurmft.slurm.validate import node_name
    from slurmft.sweep.config import SweepConfig
    from slurmft.sweep.decide import Action
    from slurmft.sweep.lock import LockHeld
    from slurmft.sweep.run import SweepRequest, sweep

    if quick and deep:
        _log("error: --quick and --deep exclude each other")
        raise typer.Exit(EXIT_USAGE)
    try:
        name = node_name(node or default_node_name())
        cfg = load_section(SweepConfig, "sweep", config_file=config)
        hc = load_health_config(config)
        client = _client(config)
        mode: Mode = "quick" if quick else "deep" if deep else "normal"
        report = sweep(SweepRequest(name, mode, dry_run, forget_xids), cfg, hc, client)
    except (ConfigError, InvalidArgument) as exc:
        _log(f"error: {exc}")
        raise typer.Exit(EXIT_USAGE)
    except LockHeld as exc:
        _log(f"node={node or default_node_name()} skipped: {exc}")
        raise typer.Exit(EXIT_LOCKED)
    except OSError as exc:  # the lock file not creatable: before anything was gathered or done
        _log(f"error: {exc.filename or ''}: {exc.strerror or exc}")
        raise typer.Exit(EXIT_USAGE)

    if as_json:
        print(numbers.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        _print_table(report)
    d = report.decision
    _log(f"node={report.node} status={report.status.value} "
         f"action={d.action.value if d else 'none'} acted={report.outcome.acted or 'nothing'}"
         + (f" reason={d.reason!r}" if d and d.reason else "")
         + (f" error={report.outcome.error or report.slurm_error!r}" if report.outcome.error or report.slurm_error else "")
         + (f" write_errors={'; '.join(report.write_errors)!r}" if report.write_errors else ""))
    for note in report.notes:  # the sweep's memory lost or forgotten: say so in the log too
        _log(f"node={report.node} note: {note}")
    if report.slurm_error or report.outcome.error:
        raise typer.Exit(EXIT_SLURM)
    if report.write_errors:
        raise typer.Exit(EXIT_WRITE)
    kept = d is not None and d.action is Action.KEEP
    raise typer.Exit(EXIT_HEALTHY if report.healthy and not kept else EXIT_UNHEALTHY)
