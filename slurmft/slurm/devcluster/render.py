"""Text of the devcluster's configuration files: slurm.conf and slurmdbd.conf (pure functions).

The lines come from configurations measured to work on Slurm 22.05, 24.11 and 26.05 with one
host running every daemon: all slurmd on 127.0.0.1 with distinct ports, proctrack/linuxproc (or
proctrack/pgid on request: slurmstepd then signals only each task's process group) and
task/none (so no cgroup.conf is needed), accounting through slurmdbd. With munge on a private
socket, ``AccountingStoragePass`` must name that socket or slurmctld 22.05 exits at start.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from slurmft.slurm.devcluster.layout import Layout, Ports

PARTITION = "debug"
DB_NAME = "slurm_acct_db"
DB_USER = "slurm"
# How long slurmctld keeps an ended job's record. A test that needs the controller to forget a
# job asks for less; slurm.conf(5) recommends at least 2 (0 would mean never purge).
DEFAULT_MIN_JOB_AGE_S = 600
MIN_JOB_AGE_RANGE_S = (2, 86400)
# How long slurmctld waits for a silent slurmd before it calls the node DOWN: short, so a killed
# node is noticed in seconds, as the tests and demo need. A benchmark of what `slurmft watch
# --operator` saves on a real cluster (300 s there by default) asks for more.
DEFAULT_SLURMD_TIMEOUT_S = 10
SLURMD_TIMEOUT_RANGE_S = (5, 3600)


_PARTITION_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")


def check_partitions(partitions: Mapping[str, Sequence[str]] | None,
                     node_names: Sequence[str]) -> tuple[tuple[str, tuple[str, ...]], ...] | None:
    """``partitions`` (name -> its nodes, the first the default) as a checked tuple, else
    ValueError naming what is wrong. None: one partition, ``debug``, of every node."""
    if partitions is None:
        return None
    if not partitions:
        raise ValueError("partitions: name at least one partition (or none at all for 'debug')")
    checked = []
    for name, nodes in partitions.items():
        if not isinstance(name, str) or not _PARTITION_RE.fullmatch(name):
            raise ValueError(f"partition name {name!r}: letters, digits, '_' or '-', at most 32")
        members = tuple(nodes)
        unknown = [n for n in members if n not in node_names]
        if not members or unknown or len(set(members)) != len(members):
            raise ValueError(f"partition {name}: its nodes {list(members)!r} must be distinct nodes "
                             f"of the cluster ({', '.join(node_names)})")
        checked.append((name, members))
    return tuple(checked)


def _whole_seconds(name: str, seconds: int, low: int, high: int) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not low <= seconds <= high:
        raise ValueError(f"{name} {seconds!r}: must be a whole number of seconds "
                         f"from {low} to {high}")
    return seconds


def check_min_job_age(seconds: int) -> int:
    """``seconds`` when it is a whole number of seconds Slurm purges after, else ValueError."""
    return _whole_seconds("min_job_age_s", seconds, *MIN_JOB_AGE_RANGE_S)


def check_slurmd_timeout(seconds: int) -> int:
    """``seconds`` when it is a usable SlurmdTimeout, else ValueError."""
    return _whole_seconds("slurmd_timeout_s", seconds, *SLURMD_TIMEOUT_RANGE_S)


# How slurmstepd finds a step's processes, and so which of them a step's signal reaches:
# linuxproc every descendant of the task, pgid only the task's process group. Not cgroup: it needs
# a cgroup.conf and a delegated cgroup tree, which the devcluster does not set up.
PROCTRACK_PLUGINS = ("linuxproc", "pgid")


def check_proctrack(plugin: str) -> str:
    """``plugin`` when the devcluster can run it (``PROCTRACK_PLUGINS``), else ValueError."""
    if plugin not in PROCTRACK_PLUGINS:
        raise ValueError(f"proctrack {plugin!r}: must be one of {', '.join(PROCTRACK_PLUGINS)}")
    return plugin


_CONF_PATH_RE = re.compile(r"/[A-Za-z0-9_./+-]*")


def check_prolog(prolog: str | None) -> str | None:
    """``prolog`` when it is a program slurm.conf can name as ``Prolog=`` (an absolute path of
    an executable regular file, no characters slurm.conf would split on), else ValueError."""
    if prolog is None:
        return None
    if not isinstance(prolog, str) or not _CONF_PATH_RE.fullmatch(prolog):
        raise ValueError(f"prolog {prolog!r}: must be an absolute path of letters, digits and "
                         "'_./+-' only")
    if not os.path.isfile(prolog) or not os.access(prolog, os.X_OK):
        raise ValueError(f"prolog {prolog}: not an executable regular file")
    return prolog


@dataclass(frozen=True)
class ConfSpec:
    """Everything the configuration files depend on."""

    layout: Layout
    cluster_name: str
    node_names: list[str]
    ports: Ports
    cpus_per_node: int
    memory_mb_per_node: int
    db_password: str
    min_job_age_s: int = DEFAULT_MIN_JOB_AGE_S
    slurmd_timeout_s: int = DEFAULT_SLURMD_TIMEOUT_S
    # (name, nodes) per partition, the first the default; None: one partition of every node.
    partitions: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    # slurm.conf's Prolog: run by every slurmd as root before a job's first launch on its node.
    prolog: str | None = None
    proctrack: str = "linuxproc"   # slurm.conf's ProctrackType (PROCTRACK_PLUGINS)

    def __post_init__(self) -> None:
        check_proctrack(self.proctrack)
        check_prolog(self.prolog)
        check_min_job_age(self.min_job_age_s)
        check_slurmd_timeout(self.slurmd_timeout_s)
        check_partitions(dict(self.partitions) if self.partitions is not None else None,
                         self.node_names)


def render_slurm_conf(spec: ConfSpec) -> str:
    lay = spec.layout
    munge = lay.munge_socket
    lines = [
        f"ClusterName={spec.cluster_name}",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={spec.ports.slurmctld}",
        f"SlurmdPort={spec.ports.slurmd_default}",
        "AuthType=auth/munge",
        f"AuthInfo=socket={munge}",
        "CredType=cred/munge",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={lay.state_dir}",
        f"SlurmdSpoolDir={lay.spool_root}/%n",
        f"SlurmctldPidFile={lay.pid_file('slurmctld')}",
        f"SlurmdPidFile={lay.run_dir}/slurmd-%n.pid",
        f"SlurmctldLogFile={lay.log('slurmctld')}",
        f"SlurmdLogFile={lay.log_dir}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"ProctrackType=proctrack/{spec.proctrack}",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        f"SlurmdTimeout={spec.slurmd_timeout_s}",
        "SlurmctldTimeout=30",
        "ReturnToService=1",
        "JobRequeue=1",
        f"MinJobAge={spec.min_job_age_s}",
        "KillWait=5",
        "InactiveLimit=0",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=localhost",
        f"AccountingStoragePort={spec.ports.slurmdbd}",
        f"AccountingStoragePass={munge}",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
    ]
    if spec.prolog is not None:
        lines.append(f"Prolog={spec.prolog}")
    for name in spec.node_names:
        lines.append(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 "
            f"Port={spec.ports.nodes[name]} CPUs={spec.cpus_per_node} "
            f"RealMemory={spec.memory_mb_per_node} State=UNKNOWN")
    partitions = spec.partitions or ((PARTITION, tuple(spec.node_names)),)
    for i, (name, members) in enumerate(partitions):
        lines.append(f"PartitionName={name} Nodes={','.join(members)} "
                     f"Default={'YES' if i == 0 else 'NO'} MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def render_slurmdbd_conf(spec: ConfSpec) -> str:
    lay = spec.layout
    lines = [
        "AuthType=auth/munge",
        f"AuthInfo=socket={lay.munge_socket}",
        "DbdHost=localhost",
        f"DbdPort={spec.ports.slurmdbd}",
        "SlurmUser=root",
        f"LogFile={lay.log('slurmdbd')}",
        f"PidFile={lay.pid_file('slurmdbd')}",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={spec.ports.mysql}",
        f"StorageUser={DB_USER}",
        f"StoragePass={spec.db_password}",
        f"StorageLoc={DB_NAME}",
    ]
    return "\n".join(lines) + "\n"


def render_db_bootstrap_sql(password: str) -> str:
    """SQL run once as MariaDB's root (unix-socket auth) to give slurmdbd its user and database.
    slurmdbd connects over TCP to 127.0.0.1, so the user is created for that host (and localhost)."""
    if not password.isalnum():
        raise ValueError("database password must be alphanumeric")
    stmts = [f"CREATE DATABASE IF NOT EXISTS {DB_NAME}"]
    for host in ("127.0.0.1", "localhost"):
        stmts.append(f"CREATE USER IF NOT EXISTS '{DB_USER}'@'{host}' IDENTIFIED BY '{password}'")
        stmts.append(f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'{host}'")
    return ";\n".join(stmts) + ";\n"
