"""torchrun's c10d rendezvous, from the environment only (no ``scontrol show hostnames``): the
first node of ``SLURM_JOB_NODELIST`` hosts the store on a port its pre-flight found free; the id
changes with every restart so a new run never joins a stale store."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

from slurmft.launch import agent, warm
from slurmft.launch.identity import JobIdentity
from slurmft.launch.settings import LaunchSettings
from slurmft.train import rdzv_poll


class RendezvousError(RuntimeError):
    pass


@dataclass(frozen=True)
class Rendezvous:
    host: str
    port: int
    rdzv_id: str

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def choose(identity: JobIdentity, ports: dict[str, int], host: str | None = None) -> Rendezvous:
    """``host`` (default: the allocation's first node) hosts the store on its pre-flight port."""
    host = host or identity.nodes[0]
    port = ports.get(host)
    if port is None:
        raise RendezvousError(f"the pre-flight on {host} (the rendezvous host) reported no free port")
    return Rendezvous(host, port, f"slurmft-{identity.slurm_id}-{identity.restart_count}")


def torchrun_argv(rdzv: Rendezvous, identity: JobIdentity, settings: LaunchSettings,
                  command: Sequence[str], python: str = sys.executable) -> list[str]:
    """What each node's task runs (after ``slurmft.launch.task`` set USR2 to ignored); with warm
    workers torchrun's worker is the client (``warm.worker_command``)."""
    return [*agent.argv(python), f"--nnodes={identity.num_nodes}",
            f"--nproc-per-node={settings.nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.rdzv_id}",
            "--max-restarts=0", "--monitor-interval=1",
            *(["--no-python", *warm.worker_command(command, python)] if settings.warm_workers
              else command)]


def step_env(env: Mapping[str, str], identity: JobIdentity) -> dict[str, str]:
    """The training step's environment: ``env`` with the agents' rendezvous poll (``rdzv_poll``).
    Every start of a requeued job forms its first round: with torch's own poll its agents saw the
    round complete up to a second or two after the last one joined (1.1-1.5 s from the last
    agent's join to the last agent's workers started, 3 nodes, ``benchmarks/startup_bench.py``)."""
    return {**env, rdzv_poll.ENV: str(rdzv_poll.poll_for(identity.num_nodes))}


def step_argv(rdzv: Rendezvous, identity: JobIdentity, settings: LaunchSettings,
              command: Sequence[str], python: str = sys.executable) -> list[str]:
    """The training step: one task per node, a failed node ends the step."""
    n = str(identity.num_nodes)
    return ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "--job-name=slurmft-train", python, "-m", "slurmft.launch.task",
            *torchrun_argv(rdzv, identity, settings, command, python)]
