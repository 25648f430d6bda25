"""``slurmft devcluster up|down|status|env``: a throwaway real Slurm cluster on this machine.

``up`` prints only ``export ...`` lines on stdout (so ``eval "$(slurmft devcluster up)"`` works),
every value quoted for the shell (and ``--dir`` may hold no shell metacharacter); its progress
goes to stderr. Every failure is one line on stderr (plus a daemon's log tail when a
daemon failed) and exit status 1.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from slurmft.slurm.devcluster import DEFAULT_NODES, MAX_NODES, DevCluster, DevClusterError
from slurmft.slurm.devcluster.release import (
    DAEMON_ENV_VAR, daemon_env_from_pairs, version_string,
)

DEFAULT_DIR = Path(".devcluster")

app = typer.Typer(help="A throwaway real Slurm cluster (munge, slurmdbd, slurmctld, N slurmd) "
                       "on 127.0.0.1, for tests and demos. Needs root.",
                  no_args_is_help=True)

T = TypeVar("T")

DirOption = typer.Option(DEFAULT_DIR, "--dir", "-d", help="Directory holding the cluster.")


def shell_exports(env: dict[str, str]) -> str:
    """``export K=V`` lines for ``eval``: every value quoted (shlex.quote), keys checked."""
    for key in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"not an environment variable name: {key!r}")
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def _guard(action: Callable[[], T]) -> T:
    try:
        return action()
    except DevClusterError as exc:
        typer.echo(f"slurmft devcluster: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def up(
    nodes: int = typer.Option(DEFAULT_NODES, "--nodes", "-n",
                              help=f"Number of nodes n1..nN (1-{MAX_NODES})."),
    dir: Path = DirOption,
    port_base: Optional[int] = typer.Option(
        None, "--port-base", help="First of the N+4 consecutive ports to use (default: a free "
                                  "block chosen at random)."),
    daemon_env: List[str] = typer.Option(
        [], "--daemon-env",
        help="KEY=VALUE added to every daemon's environment (repeatable; default: "
             f"${DAEMON_ENV_VAR}, whitespace-separated), e.g. LD_LIBRARY_PATH for slurmdbd."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds to wait for the cluster."),
) -> None:
    """Start a cluster and print the exports that point Slurm commands at it."""
    started = time.monotonic()

    def start() -> DevCluster:
        env = daemon_env_from_pairs(daemon_env) if daemon_env else None
        return DevCluster.up(dir, nodes=nodes, port_base=port_base, daemon_env=env,
                             timeout=timeout)

    cluster = _guard(start)
    version = version_string(cluster.slurm_version)
    typer.echo(f"devcluster {cluster.cluster_name} up: Slurm {version}, nodes "
               f"{','.join(cluster.node_names)}, in {time.monotonic() - started:.1f} s "
               f"(stop it with: slurmft devcluster down --dir {cluster.dir})", err=True)
    sys.stdout.write(shell_exports(cluster.env))


@app.command()
def down(dir: Path = DirOption) -> None:
    """Stop every process of the cluster and remove its files (log/ is kept)."""
    started = time.monotonic()

    def stop() -> tuple[str, bool]:
        cluster = DevCluster.attach(dir, running=False)
        was_running = cluster.is_running()
        cluster.down()
        return cluster.cluster_name, was_running

    name, was_running = _guard(stop)
    what = "down" if was_running else "was not running; cleaned up"
    typer.echo(f"devcluster {name} {what} in {time.monotonic() - started:.1f} s", err=True)


@app.command()
def env(dir: Path = DirOption) -> None:
    """Print the exports for the running cluster again."""
    sys.stdout.write(shell_exports(_guard(lambda: DevCluster.attach(dir)).env))


@app.command()
def status(dir: Path = DirOption) -> None:
    """Show the cluster's nodes and jobs."""
    cluster = _guard(lambda: DevCluster.attach(dir))
    node_states = _guard(cluster.nodes)
    jobs = _guard(cluster.jobs)
    console = Console()
    version = version_string(cluster.slurm_version)
    nodes_table = Table(title=f"devcluster {cluster.cluster_name} (Slurm {version}) in "
                              f"{cluster.dir}")
    for column in ("node", "state", "slurmd", "reason"):
        nodes_table.add_column(column)
    for name in cluster.node_names:
        node = node_states.get(name)
        nodes_table.add_row(name, node.describe() if node else "?",
                            "running" if cluster.node_alive(name) else "dead",
                            node.reason if node else "")
    console.print(nodes_table)
    jobs_table = Table(title=f"jobs ({len(jobs)})")
    for column in ("job", "name", "state", "elapsed", "nodes", "reason"):
        jobs_table.add_column(column)
    for job in jobs:
        jobs_table.add_row(job.job_id, job.name, job.state, job.elapsed, job.nodes, job.reason)
    console.print(jobs_table)
