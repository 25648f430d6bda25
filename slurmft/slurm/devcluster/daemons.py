"""Starting the devcluster's daemons in the foreground and waiting (bounded) until each serves.

Every daemon runs in the foreground (``-D`` / ``--foreground``), in its own session, so the pid
we get from the fork IS the daemon: nothing to chase through pid files, and Ctrl-C in the
terminal that ran ``up`` does not reach it. Its stdout/stderr go to ``log/<name>.out`` beside the
log the daemon writes itself; when it dies or does not become ready in time, the error carries
the tail of both.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from slurmft.slurm.devcluster.errors import DevClusterError
from slurmft.slurm.devcluster.layout import Layout, Ports
from slurmft.slurm.devcluster.procs import ProcId, identify, is_alive, reap_if_child
from slurmft.slurm.devcluster.release import Binaries, mariadbd_release_args
from slurmft.slurm.devcluster.render import render_db_bootstrap_sql

LOG_TAIL_LINES = 15
INSTALL_DB_TIMEOUT_S = 180.0
SQL_TIMEOUT_S = 20.0
POLL_S = 0.1
# Set in every daemon's environment; slurmstepd inherits it from its slurmd, which is how
# ``kill_node`` finds a node's step daemons even after they are re-parented away from slurmd.
NODE_MARK_ENV = "SLURMFT_DEVCLUSTER_NODE"


class DaemonFailed(DevClusterError):
    """A daemon exited or did not become ready; the message names it and ends with its log."""


def out_file(layout: Layout, name: str) -> Path:
    return layout.log_dir / f"{name}.out"


def log_tail(paths: list[Path], lines: int = LOG_TAIL_LINES) -> str:
    parts = []
    for path in paths:
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        if text:
            parts.append(f"--- {path} (last {min(lines, len(text))} lines)")
            parts.extend(text[-lines:])
    return "\n".join(parts) if parts else "(no log output)"


def spawn(layout: Layout, name: str, argv: list[str], env: Mapping[str, str]) -> ProcId:
    """Start one daemon in its own session, in the cluster's directory, output to
    log/<name>.out; return its identity."""
    with open(out_file(layout, name), "ab") as out:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=dict(env),
                                    start_new_session=True, close_fds=True,
                                    # not the caller's directory: a crashing slurmstepd leaves
                                    # `core` files in it, HealthCheckProgram runs in it
                                    cwd=layout.root)
        except OSError as exc:
            raise DaemonFailed(f"{name} did not start: {argv[0]}: {exc.strerror}") from None
    ident = identify(proc.pid)
    if ident is None:  # exited (and became unreadable) before we looked
        proc.wait()
        raise DaemonFailed(f"{name} exited at once (status {proc.returncode})\n"
                           + log_tail([out_file(layout, name)]))
    # The Popen object is dropped on purpose: the daemon outlives this process. Reaping is
    # done by pid (procs.reap_if_child) when we stop it ourselves.
    proc.returncode = 0  # keeps Popen.__del__ from warning about a still-running child
    return ident


def wait_until(name: str, proc: ProcId, ready: Callable[[], bool], timeout: float,
               logs: list[Path], what: str) -> None:
    """Poll ``ready()`` until true; fail early, with the log tail, when ``proc`` dies."""
    deadline = time.monotonic() + timeout
    while not ready():
        reap_if_child(proc.pid)
        if not is_alive(proc):
            raise DaemonFailed(f"{name} exited before {what}\n{log_tail(logs)}")
        if time.monotonic() >= deadline:
            raise DaemonFailed(f"{name} did not reach '{what}' within {timeout:.0f} s\n"
                               f"{log_tail(logs)}")
        time.sleep(POLL_S)


def base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment minus anything Slurm- or devcluster-specific: a daemon started
    from inside a job of another cluster must not carry that job's identity (or node mark)."""
    return {k: v for k, v in environ.items()
            if not k.startswith(("SLURM_", "SLURMD_")) and k != NODE_MARK_ENV}


def unix_socket_accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def tcp_accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def write_munge_key(layout: Layout) -> None:
    """A fresh random key (munge wants >= 32 bytes, private to its owner)."""
    fd = os.open(layout.munge_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
    try:
        os.write(fd, secrets.token_bytes(1024))
        os.fsync(fd)
    finally:
        os.close(fd)


def munged_argv(bins: Binaries, layout: Layout) -> list[str]:
    # --force turns munged's "every directory above the socket must be searchable by all"
    # error into a warning: the cluster dir may sit in a private (0700) temp dir such as
    # pytest's, and only root, which can search it anyway, talks to this socket.
    return [bins.munged, "--foreground", "--force", f"--socket={layout.munge_socket}",
            f"--key-file={layout.munge_key}", f"--pid-file={layout.pid_file('munged')}",
            f"--log-file={layout.log('munged')}", f"--seed-file={layout.munge_seed}"]


def install_mariadb(bins: Binaries, layout: Layout, env: Mapping[str, str]) -> None:
    """Create MariaDB's system tables in our datadir (root authenticates by unix socket)."""
    argv = [bins.mariadb_install_db, "--no-defaults", f"--datadir={layout.mysql_datadir}",
            f"--tmpdir={layout.mysql_tmpdir}", "--user=root",
            "--auth-root-authentication-method=socket", "--skip-test-db"]
    log = out_file(layout, "mariadb-install-db")
    with open(log, "ab") as out:
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, env=dict(env),
                                  timeout=INSTALL_DB_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise DaemonFailed(f"mariadb-install-db did not finish within "
                               f"{INSTALL_DB_TIMEOUT_S:.0f} s\n{log_tail([log])}") from None
    if done.returncode != 0:
        raise DaemonFailed(f"mariadb-install-db failed (exit {done.returncode})\n"
                           f"{log_tail([log])}")


def mariadbd_argv(bins: Binaries, layout: Layout, port: int,
                  mariadb_version: tuple[int, int, int]) -> list[str]:
    return [bins.mariadbd, "--no-defaults", f"--datadir={layout.mysql_datadir}",
            f"--tmpdir={layout.mysql_tmpdir}", f"--socket={layout.mysql_socket}", f"--port={port}", "--bind-address=127.0.0.1",
            f"--pid-file={layout.pid_file('mariadbd')}", f"--log-error={layout.log('mariadbd')}",
            "--user=root", "--skip-name-resolve", "--innodb-buffer-pool-size=64M",
            *mariadbd_release_args(mariadb_version)]


def bootstrap_database(bins: Binaries, layout: Layout, password: str,
                       env: Mapping[str, str]) -> None:
    argv = [bins.mariadb, "--no-defaults", f"--socket={layout.mysql_socket}", "--user=root",
            "--batch"]
    try:
        done = subprocess.run(argv, input=render_db_bootstrap_sql(password), text=True,
                              capture_output=True, env=dict(env), timeout=SQL_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise DaemonFailed(f"creating the slurm database user timed out after "
                           f"{SQL_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise DaemonFailed(f"creating the slurm database user failed: {done.stderr.strip()}")


def slurmd_argv(bins: Binaries, layout: Layout, node: str, stepd: str | None = None) -> list[str]:
    """``stepd``: the slurmstepd this slurmd launches jobs with (``slurmd -d``); None: Slurm's."""
    return [bins.slurmd, "-D", "-N", node, "-f", str(layout.slurm_conf),
            *(["-d", stepd] if stepd is not None else [])]


@dataclass(frozen=True)
class Service:
    """One of the cluster-wide daemons: how to start it and how to tell it serves."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    what: str  # the readiness condition, for error messages
    logs: list[Path]


def services(bins: Binaries, layout: Layout, ports: Ports,
             mariadb_version: tuple[int, int, int]) -> list[Service]:
    """munged, mariadbd, slurmdbd, slurmctld, in start order (each needs the ones before)."""

    def logs(name: str) -> list[Path]:
        return [layout.log(name), out_file(layout, name)]

    return [
        Service("munged", munged_argv(bins, layout),
                lambda: unix_socket_accepts(layout.munge_socket),
                "its socket accepts connections", logs("munged")),
        Service("mariadbd", mariadbd_argv(bins, layout, ports.mysql, mariadb_version),
                lambda: unix_socket_accepts(layout.mysql_socket),
                "its socket accepts connections", logs("mariadbd")),
        Service("slurmdbd", [bins.slurmdbd, "-D"], lambda: tcp_accepts(ports.slurmdbd),
                f"listening on port {ports.slurmdbd}", logs("slurmdbd")),
        # -i: a controller restarted after a crash (reset() after kill -9) must come up from
        # whatever state it had saved; 26.05 is fatal on a missing assoc_usage file without it.
        Service("slurmctld", [bins.slurmctld, "-D", "-i", "-f", str(layout.slurm_conf)],
                lambda: tcp_accepts(ports.slurmctld),
                f"listening on port {ports.slurmctld}", logs("slurmctld")),
    ]


def node_log(layout: Layout, node: str) -> Path:
    """Where slurm.conf's ``SlurmdLogFile=.../slurmd-%n.log`` puts this node's log."""
    return layout.log_dir / f"slurmd-{node}.log"


def slurmd_logs(layout: Layout, node: str) -> list[Path]:
    """The node's slurmd log, then what its slurmd wrote to stdout/stderr."""
    return [node_log(layout, node), out_file(layout, f"slurmd-{node}")]


def last_line(path: Path) -> str:
    lines = log_tail([path], lines=1).splitlines()
    return lines[-1] if len(lines) > 1 else "(no log output)"
