"""Where everything of one devcluster lives inside its directory, and its state file.

The directory ``D`` holds the whole cluster: configs, munge key and socket, MariaDB datadir,
Slurm state and spool, each node's local disk (``local/<node>``), logs and pid files.
``D/devcluster.json`` (written atomically) records what
``up`` started — every daemon as (pid, start time), the ports, node names and the Slurm release —
so that ``down``, ``env`` and ``status`` (possibly from another process) act on exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmft.rundir import atomic_write_json, read_json
from slurmft.slurm.devcluster.errors import DevClusterError
from slurmft.slurm.devcluster.procs import ProcId

STATE_VERSION = 1


@dataclass(frozen=True)
class Layout:
    """Paths inside one devcluster directory. Creating it touches nothing on disk."""

    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "devcluster.json"

    @property
    def lock_file(self) -> Path:
        return self.root / ".devcluster.lock"

    @property
    def slurm_conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        return self.root / "slurmdbd.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket.2"

    @property
    def munge_seed(self) -> Path:
        return self.munge_dir / "munged.seed"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def spool_root(self) -> Path:
        return self.root / "spool"

    @property
    def mysql_datadir(self) -> Path:
        return self.root / "mysql" / "data"

    @property
    def mysql_socket(self) -> Path:
        return self.root / "mysql" / "mysqld.sock"

    @property
    def mysql_tmpdir(self) -> Path:
        """MariaDB's own tmpdir: a mariadbd deletes the ``#sql*`` files it finds in its tmpdir
        when it starts, so clusters that shared /tmp broke each other's start (measured: two
        suites side by side, "Error on delete of '/tmp/#sql-temptable-...'" in install-db)."""
        return self.root / "mysql" / "tmp"

    def log(self, daemon: str) -> Path:
        return self.log_dir / f"{daemon}.log"

    def pid_file(self, daemon: str) -> Path:
        return self.run_dir / f"{daemon}.pid"

    def spool(self, node: str) -> Path:
        return self.spool_root / node

    @property
    def local_root(self) -> Path:
        """Each node's own "local disk" (``local/<node>``): the node-local checkpoint tier's
        ``[checkpoint] local_dir = "<D>/local/{node}"`` gives every node its own directory."""
        return self.root / "local"

    def local(self, node: str) -> Path:
        return self.local_root / node

    def make_dirs(self, node_names: list[str]) -> None:
        """Create the directory tree. munged wants its socket directory searchable by all and
        writable by its owner only (the key itself is 0400)."""
        for path in (self.root, self.log_dir, self.run_dir, self.state_dir, self.spool_root,
                     self.mysql_datadir.parent, self.mysql_tmpdir):
            path.mkdir(parents=True, exist_ok=True)
        self.munge_dir.mkdir(mode=0o755, exist_ok=True)
        self.munge_dir.chmod(0o755)
        self.local_root.mkdir(exist_ok=True)
        for node in node_names:
            self.spool(node).mkdir(exist_ok=True)
            self.local(node).mkdir(exist_ok=True)


@dataclass(frozen=True)
class Ports:
    """TCP ports on 127.0.0.1; one per daemon plus one per slurmd."""

    slurmctld: int
    slurmd_default: int
    slurmdbd: int
    mysql: int
    nodes: dict[str, int]

    def all(self) -> list[int]:
        return [self.slurmctld, self.slurmd_default, self.slurmdbd, self.mysql, *self.nodes.values()]

    def to_json(self) -> dict[str, Any]:
        return {"slurmctld": self.slurmctld, "slurmd_default": self.slurmd_default,
                "slurmdbd": self.slurmdbd, "mysql": self.mysql, "nodes": dict(self.nodes)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Ports":
        return cls(slurmctld=int(data["slurmctld"]), slurmd_default=int(data["slurmd_default"]),
                   slurmdbd=int(data["slurmdbd"]), mysql=int(data["mysql"]),
                   nodes={str(k): int(v) for k, v in data["nodes"].items()})


@dataclass
class ClusterState:
    """What ``up`` started; saved after every daemon start so a failed ``up`` can be undone."""

    cluster_name: str
    node_names: list[str]
    ports: Ports
    slurm_version: tuple[int, int, int]
    daemon_env: dict[str, str] = field(default_factory=dict)
    processes: dict[str, ProcId] = field(default_factory=dict)
    hosts_names: list[str] = field(default_factory=list)
    ready: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "cluster_name": self.cluster_name,
            "node_names": list(self.node_names),
            "ports": self.ports.to_json(),
            "slurm_version": list(self.slurm_version),
            "daemon_env": dict(self.daemon_env),
            "processes": {name: p.to_json() for name, p in self.processes.items()},
            "hosts_names": list(self.hosts_names),
            "ready": self.ready,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ClusterState":
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"state version {data.get('version')!r}, expected {STATE_VERSION}")
        major, minor, patch = (int(x) for x in data["slurm_version"])
        return cls(
            cluster_name=str(data["cluster_name"]),
            node_names=[str(n) for n in data["node_names"]],
            ports=Ports.from_json(data["ports"]),
            slurm_version=(major, minor, patch),
            daemon_env={str(k): str(v) for k, v in data.get("daemon_env", {}).items()},
            processes={str(k): ProcId.from_json(v) for k, v in data["processes"].items()},
            hosts_names=[str(n) for n in data.get("hosts_names", [])],
            ready=bool(data.get("ready", False)),
        )

    def save(self, layout: Layout) -> None:
        atomic_write_json(layout.state_file, self.to_json())


def load_state(layout: Layout) -> ClusterState:
    """Read the state file; a missing or unreadable one is a DevClusterError naming the path."""
    path = layout.state_file
    try:
        return ClusterState.from_json(read_json(path))
    except FileNotFoundError:
        raise DevClusterError(f"no devcluster in {layout.root} ({path.name} not found)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DevClusterError(f"{path}: unreadable devcluster state ({exc})") from None
