"""Who and where this training process is: the ONE reader of the job's environment.

Rank, local rank, world size (torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, else srun's
``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``), the node name, the Slurm job id, the
restart count and the node list are read here once, validated, and passed around as a frozen
``JobEnv``; no other module reads ``SLURM_*`` variables. Torch-free itself (it lives under
``train/`` because only the in-job side needs it).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping


class JobEnvError(ValueError):
    """An environment variable the job depends on has a wrong value; the message names it."""


@dataclass(frozen=True)
class JobEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node: str
    job_id: str | None
    restart_count: int
    num_nodes: int
    nodelist: str | None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        """Local rank 0: the one process per node that writes the node's heartbeat."""
        return self.local_rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "JobEnv":
        env = os.environ if environ is None else environ

        def integer(names: tuple[str, ...], default: int, minimum: int) -> int:
            for name in names:
                raw = env.get(name)
                if raw is None or raw == "":
                    continue
                try:
                    value = int(raw)
                except ValueError:
                    raise JobEnvError(f"${name}={raw!r} is not an integer") from None
                if value < minimum:
                    raise JobEnvError(f"${name}={value} must be >= {minimum}")
                return value
            return default

        world = integer(("WORLD_SIZE", "SLURM_NTASKS"), 1, 1)
        rank = integer(("RANK", "SLURM_PROCID"), 0, 0)
        if rank >= world:
            raise JobEnvError(f"rank {rank} is not below the world size {world}")
        local_world = integer(("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"), 1, 1)
        local_rank = integer(("LOCAL_RANK", "SLURM_LOCALID"), 0, 0)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=local_world,
            node=env.get("SLURMD_NODENAME") or socket.gethostname(),
            job_id=env.get("SLURM_JOB_ID") or None,
            restart_count=integer(("SLURM_RESTART_COUNT",), 0, 0),
            num_nodes=integer(("SLURM_JOB_NUM_NODES", "SLURM_NNODES"), 1, 1),
            nodelist=env.get("SLURM_JOB_NODELIST") or None,
        )
