"""``slurmft sweep``'s body: one sweep of a node run, its report printed, its exit code returned.

Two ways in, the same options and the same code from here on: the CLI (``slurmft sweep``,
``slurmft.commands.sweep``, typer) and ``python -m slurmft.sweep.main [OPTIONS]`` (argparse),
which the pre-flight runs on every node of every job start (``launch/nodecheck.py``). typer's
start-up (0.29: its own click, and a pydantic ``TypeAdapter`` built for each option) was ~0.17 of
the ~0.4 CPU-s of a quick dry-run sweep (``benchmarks/sweep_bench.py``), paid on each node before
its job can train. Unlike the CLI, ``-h`` is help here too, and a value may not start with ``-``.

Exit codes:

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

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Optional, Sequence

from slurmft import numbers
from slurmft.config import ConfigError, load_section

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_USAGE, EXIT_LOCKED, EXIT_SLURM, EXIT_WRITE = 0, 1, 2, 3, 4, 5

# (flag, help) of each option, both ways in; every one but --node and --config is a switch.
OPTIONS = (
    ("--node", "Slurm node name (default: this host's)."),
    ("--config", "slurmft.toml to read."),
    ("--quick", "Cheap checks only (the sbatch pre-flight)."),
    ("--deep", "Also run slow diagnostics (dcgmi diag -r 1)."),
    ("--dry-run", "Decide and print; drain, resume and write nothing."),
    ("--json", "Print the report as one JSON object."),
    ("--forget-xids", "Forget remembered drain-level Xids (after a GPU reset)."),
)
HELP = dict(OPTIONS)
VALUED = ("--node", "--config")


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


def run(node: Optional[str], config: Optional[Path], quick: bool, deep: bool, dry_run: bool,
        as_json: bool, forget_xids: bool) -> int:
    """One sweep of ``node`` (default: this host's) with the CLI's options; its exit code."""
    from slurmft.health.registry import Mode, load_health_config
    from slurmft.slurm.client import InvalidArgument
    from slurmft.slurm.validate import node_name
    from slurmft.sweep.config import SweepConfig
    from slurmft.sweep.decide import Action
    from slurmft.sweep.lock import LockHeld
    from slurmft.sweep.run import SweepRequest, sweep

    if quick and deep:
        _log("error: --quick and --deep exclude each other")
        return EXIT_USAGE
    try:
        name = node_name(node or default_node_name())
        cfg = load_section(SweepConfig, "sweep", config_file=config)
        hc = load_health_config(config)
        client = _client(config)
        mode: Mode = "quick" if quick else "deep" if deep else "normal"
        report = sweep(SweepRequest(name, mode, dry_run, forget_xids), cfg, hc, client)
    except (ConfigError, InvalidArgument) as exc:
        _log(f"error: {exc}")
        return EXIT_USAGE
    except LockHeld as exc:
        _log(f"node={node or default_node_name()} skipped: {exc}")
        return EXIT_LOCKED
    except OSError as exc:  # the lock file not creatable: before anything was gathered or done
        _log(f"error: {exc.filename or ''}: {exc.strerror or exc}")
        return EXIT_USAGE

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
        return EXIT_SLURM
    if report.write_errors:
        return EXIT_WRITE
    kept = d is not None and d.action is Action.KEEP
    return EXIT_HEALTHY if report.healthy and not kept else EXIT_UNHEALTHY


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # the CLI's usage code (argparse's own is 2 as well) and line
        _log(f"error: {message}")
        raise SystemExit(EXIT_USAGE)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m slurmft.sweep.main", allow_abbrev=False,
                description="slurmft sweep, without the CLI's start-up: the same options and exit codes.")
    for flag, text in OPTIONS:
        if flag in VALUED:
            p.add_argument(flag, type=Path if flag == "--config" else str, help=text)
        else:
            p.add_argument(flag, action="store_true", help=text)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run(args.node, args.config, args.quick, args.deep, args.dry_run, args.json, args.forget_xids)


if __name__ == "__main__":
    sys.exit(main())
