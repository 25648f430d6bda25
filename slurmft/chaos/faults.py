"""The faults the chaos demo and the soak inject into a training job on a devcluster, each done
the way it happens on a real cluster: a node's slurmd and processes die (SIGKILL), a rank stops
(SIGSTOP: a hung collective for everyone else), the health sweeper finds a failing check on an
allocated node and drains it, the newest checkpoint's bytes rot before the run must load it, the
ranks crash (SIGKILL: no handler runs), and Slurm sends the time-limit signal (USR2 to the batch
script, as ``--signal=B:USR2@120`` does before the limit).

Each fault names the causes ``slurmft watch`` may journal for it, and may repair afterwards what
it broke on the cluster (a dead node restarted, the failing check fixed and the sweeper run again,
which resumes its own drain): the next fault then finds the cluster whole, as an admin would leave it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slurmft import allocation
from slurmft.launch import warm
from slurmft.rundir import RunDir
from slurmft.slurm.client import SlurmClient
from slurmft.slurm.devcluster import DevCluster

SWEEP_TIMEOUT_S = 120


class FaultError(RuntimeError):
    """A fault could not be injected (nothing to kill, the sweeper did not drain...)."""


@dataclass
class Target:
    """What the faults act on: one job of one devcluster, its run dir and its training script."""
    cluster: DevCluster
    client: SlurmClient
    job_id: str
    run_dir: RunDir
    script: Path
    work_dir: Path                          # for the sweeper's config and its state
    repairs: list[Callable[[], None]] = field(default_factory=list)
    victim: str | None = None               # the node the last node fault hit
    corrupted: int | None = None            # the checkpoint the last corruption hit

    def nodes(self) -> list[str]:
        nodes = self.client.job(self.job_id).nodes
        if not nodes:
            raise FaultError(f"job {self.job_id} has no nodes (not running)")
        return list(nodes)


@dataclass(frozen=True)
class Fault:
    name: str
    causes: frozenset[str]                  # the cause the watcher may journal (fault_detected or planned_end)
    inject: Callable[[Target], str]         # does it; returns what it did, in words


def _proc(pid: str) -> tuple[list[bytes], list[bytes]] | None:
    """(environ, argv) of a process, None when it is gone or not ours to read."""
    try:
        return ((Path("/proc") / pid / "environ").read_bytes().split(b"\0"),
                (Path("/proc") / pid / "cmdline").read_bytes().split(b"\0"))
    except OSError:
        return None


def _ppid(pid: int) -> int | None:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _fd_target(pid: int, fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None


def warm_workers(client_pid: int, environ: list[bytes]) -> list[int]:
    """The worker a warm client (``launch/warmclient.py``) stands for: a child of its node's warm
    server (``launch.warm.is_server``; forked from torchrun's agent, whose environment names the
    client's ``SLURMFT_WARM_SOCKET``, or started on its own with the socket in its argv) with the
    client's stderr (the server hands the worker the client's stdio). A forked worker's /proc
    environ and cmdline are its agent's: the rank cannot be read from them."""
    sock = next((v for v in environ if v.startswith(b"SLURMFT_WARM_SOCKET=")), None)
    if not sock:
        return []
    path = sock.split(b"=", 1)[1]   # a server started on its own names it in its argv
    stderr = _fd_target(client_pid, 2)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        parent = _ppid(pid)
        if parent is None or not warm.is_server(parent) or warm.is_server(pid):
            continue
        parent_seen = _proc(str(parent))
        if parent_seen is not None and (sock in parent_seen[0] or path in parent_seen[1]) \
                and _fd_target(pid, 2) == stderr:
            found.append(pid)
    return found


def rank_pids(cluster: str, job_id: str, script: Path, rank: int | None = None,
              training_only: bool = False) -> list[int]:
    """The training processes of ``job_id`` of devcluster ``cluster`` on this machine:
    ``python -u SCRIPT`` with the job's SLURM_JOB_ID and SLURM_CLUSTER_NAME in their environment
    (another cluster on this machine may have a job of the same number; torchrun and the
    launcher name the script later in their argv); with ``rank``, only that global rank's.
    With warm workers (``SLURMFT_WARM_WORKERS``), torchrun's rank is the warm client
    (``python -I -S .../warmclient.py -- SCRIPT ...``): it and the worker it stands for; with
    ``training_only``, the worker alone (the client is slurmft's relay, not the training: a hung
    rank leaves it running, and it is what ends a frozen worker's restart, ``warmclient``)."""
    job_mark = f"SLURM_JOB_ID={job_id}".encode()
    cluster_mark = f"SLURM_CLUSTER_NAME={cluster}".encode()
    rank_mark = f"RANK={rank}".encode() if rank is not None else None
    script_mark = str(script).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        seen = _proc(entry.name)
        if seen is None:
            continue
        environ, argv = seen
        if job_mark not in environ or cluster_mark not in environ or (
                rank_mark is not None and rank_mark not in environ):
            continue
        if script_mark in argv[1:3]:
            found.append(int(entry.name))
        elif len(argv) > 4 and argv[3].endswith(b"warmclient.py") and script_mark in argv[4:8]:
            found += [*([] if training_only else [int(entry.name)]),
                      *warm_workers(int(entry.name), environ)]
    return found


def _signal_all(pids: list[int], sig: int) -> int:
    done = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            done += 1
        except ProcessLookupError:
            pass
    return done


def crash(target: Target) -> str:
    killed = _signal_all(rank_pids(target.cluster.cluster_name, target.job_id, target.script), signal.SIGKILL)
    if not killed:
        raise FaultError(f"job {target.job_id}: no training process of {target.script.name} to kill")
    return f"SIGKILL to all {killed} training processes (no handler runs, nothing is saved)"


def hang(target: Target) -> str:
    stopped = _signal_all(rank_pids(target.cluster.cluster_name, target.job_id, target.script, rank=1,
                                    training_only=True), signal.SIGSTOP)
    if not stopped:
        raise FaultError(f"job {target.job_id}: no process of rank 1 to stop")
    return ("SIGSTOP to rank 1's training process (of a warm rank, its worker, not its client): the "
            "other ranks wait in a collective, nothing exits")


def active_nodes(run_dir: RunDir) -> list[str]:
    """The nodes an in-allocation run trains on, from its ``allocation.json`` (the launcher's,
    read by ``slurmft.allocation``'s checked reader). Empty for any other run, and for a record
    that cannot be read or does not check (the caller then falls back to the job's nodes)."""
    try:
        record = allocation.read(run_dir)
    except allocation.AllocationError:
        return []
    return [] if record is None else list(record.active)


def spare_job_nodes(run_dir: RunDir) -> set[str]:
    """The nodes of the run's spare jobs (``SLURMFT_SPARE_REFILL=1``): not in the job's own node
    list, yet training once one took a place."""
    try:
        record = allocation.read(run_dir)
    except allocation.AllocationError:
        return set()
    return set() if record is None else {j.node for j in record.spare_jobs if j.node}


def training_victim(target: Target) -> str:
    """The node a node fault hits: in the allocation, a training node other than the batch host
    (whose loss ends the job: that is the requeue path's, measured apart), a spare job's node
    among them; a spare's would test nothing. Else the job's last node, which is never the batch
    host either."""
    nodes = target.nodes()
    batch = target.client.job(target.job_id).batch_host or nodes[0]
    ours = {*nodes, *spare_job_nodes(target.run_dir)}
    training = [n for n in active_nodes(target.run_dir) if n in ours and n != batch]
    return training[-1] if training else nodes[-1]


def node_death(target: Target) -> str:
    victim = target.victim = training_victim(target)
    target.cluster.kill_node(victim)
    target.repairs.append(lambda: target.cluster.start_node(victim, wait_timeout=60))
    return f"node {victim} died: its slurmd and every process on it SIGKILLed"


def corrupt_newest(target: Target) -> str:
    # Stopped first, so that no newer checkpoint commits between choosing "the newest" and the
    # crash that makes the run load it.
    ranks = rank_pids(target.cluster.cluster_name, target.job_id, target.script)
    if not _signal_all(ranks, signal.SIGSTOP):
        raise FaultError(f"job {target.job_id}: no training process of {target.script.name} to stop")
    try:
        steps = target.run_dir.committed_steps()
        if not steps:
            raise FaultError(f"{target.run_dir.root}: no committed checkpoint to corrupt")
        shards = sorted(target.run_dir.checkpoint(steps[-1]).glob("*.distcp"))
        if not shards:
            raise FaultError(f"checkpoint of step {steps[-1]} has no .distcp shard")
        with open(shards[0], "r+b") as fh:  # one flipped bit's worth of rot, in place
            size = fh.seek(0, os.SEEK_END)
            fh.seek(size // 2)
            byte = fh.read(1)
            fh.seek(size // 2)
            fh.write(bytes([byte[0] ^ 0xFF]))
        target.corrupted = steps[-1]
    finally:
        killed = _signal_all(ranks, signal.SIGKILL)  # a stopped process dies of SIGKILL too
    return (f"one byte of {shards[0].name} of checkpoint {steps[-1]} flipped, then SIGKILL to "
            f"all {killed} training processes")


def time_limit(target: Target) -> str:
    target.client.cancel(target.job_id, signal="USR2", batch_only=True)
    return "USR2 to the batch script, what Slurm sends 120 s before the time limit"


def _sweep_config(work_dir: Path, flag: Path) -> Path:
    """A sweeper config whose one site check fails while ``flag`` exists."""
    script = work_dir / "site-check"
    script.write_text(f"#!/bin/sh\nif [ -e {shlex.quote(str(flag))} ]; then\n"
                      "  echo 'ERROR: site check: /scratch is read-only'; exit 1\nfi\nexit 0\n")
    script.chmod(0o755)

    def toml(path: Path) -> str:  # a JSON string is a TOML basic string, any path quoted
        return json.dumps(str(path))
    config = work_dir / "sweep.toml"
    config.write_text(f"""[sweep]
checks = ["external_site"]
state_dir = {toml(work_dir / "sweep-state")}
report_dir = {toml(work_dir / "sweep-reports")}
textfile_dir = {toml(work_dir / "sweep-textfile")}

[[health_external.commands]]
name = "site"
argv = [{toml(script)}]
timeout_s = 15
""")
    return config


def run_sweeper(target: Target, node: str, config: Path) -> subprocess.CompletedProcess[str]:
    """``slurmft sweep --node NODE`` as cron or HealthCheckProgram runs it."""
    return subprocess.run([sys.executable, "-m", "slurmft.cli", "sweep", "--node", node,
                           "--config", str(config)],
                          env={**os.environ, **target.cluster.env}, text=True,
                          capture_output=True, timeout=SWEEP_TIMEOUT_S, check=False)


def unhealthy_node(target: Target) -> str:
    # In the allocation, a training node other than the batch host, as a node death (the
    # launcher replaces it with a spare). On the requeue path the job's first node, as before:
    # any node's drain is a requeue there (the demo's and the requeue soak's figures keep it).
    victim = target.victim = (training_victim(target) if active_nodes(target.run_dir)
                              else target.nodes()[0])
    work = target.work_dir / "sweep"
    work.mkdir(parents=True, exist_ok=True)
    flag = work / "scratch-broken"
    flag.touch()
    config = _sweep_config(work, flag)
    res = run_sweeper(target, victim, config)
    if res.returncode != 1:
        raise FaultError(f"slurmft sweep --node {victim} exited {res.returncode}, not 1 (drained): "
                         f"{(res.stderr or res.stdout).strip()[-500:]}")

    def repair() -> None:
        flag.unlink(missing_ok=True)
        again = run_sweeper(target, victim, config)
        if again.returncode != 0:
            raise FaultError(f"slurmft sweep --node {victim} after the repair exited "
                             f"{again.returncode}: {(again.stderr or again.stdout).strip()[-500:]}")
    target.repairs.append(repair)
    return f"the sweeper's site check failed on {victim}: it drained the node (reason slurmft:...)"


# The causes the watcher journals for a requeue, and the launcher (``where: allocation``) for a
# recovery inside the allocation (issue 27's contract).
ALLOCATION = "allocation"
NODE_DEATH = Fault("node death", frozenset({"node_fail", "node_down", "node_death", "node_silent"}),
                   node_death)
HANG = Fault("hang", frozenset({"hang"}), hang)
UNHEALTHY_NODE = Fault("failing health check", frozenset({"node_unhealthy"}), unhealthy_node)
CORRUPT_NEWEST = Fault("corrupted checkpoint", frozenset({"crash", "rank_crash"}), corrupt_newest)
CRASH = Fault("crash", frozenset({"crash", "rank_crash"}), crash)
TIME_LIMIT = Fault("time limit", frozenset({"preempted"}), time_limit)

ALL = (NODE_DEATH, HANG, UNHEALTHY_NODE, CORRUPT_NEWEST, CRASH, TIME_LIMIT)
BY_NAME = {f.name: f for f in ALL}
