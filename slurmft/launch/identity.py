"""Who this job is, read once from Slurm's environment: the job id Slurm commands must be given
(array-aware), the restart count, the node list (expanded with python-hostlist, no scontrol).

For a task of an array job, ``SLURM_JOB_ID`` is the task's own id, but the array's first task
has the ARRAY's id: ``scancel``/``scontrol`` given that bare id act on every task. Every Slurm
call and every journal line therefore uses ``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>``
whenever the array variables are set. Heterogeneous jobs are refused: the launcher starts one
homogeneous step across the allocation and has no rule for components.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import hostlist


class IdentityError(ValueError):
    """The Slurm environment is missing, malformed or of a kind the launcher refuses."""


_ID_RE = re.compile(r"^[1-9][0-9]{0,9}$")
_TASK_RE = re.compile(r"^[0-9]{1,10}$")
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Set in every heterogeneous job (SLURM_PACK_* before 19.05).
_HET_MARKERS = ("SLURM_HET_SIZE", "SLURM_PACK_SIZE")


@dataclass(frozen=True)
class JobIdentity:
    raw_job_id: str            # $SLURM_JOB_ID: what the ranks journal, unique per array task
    slurm_id: str              # what Slurm commands and the launcher's journal lines use
    array_job_id: str | None
    array_task_id: str | None
    restart_count: int
    nodes: tuple[str, ...]     # the allocation, in Slurm's order
    batch_node: str

    @property
    def is_array_task(self) -> bool:
        return self.array_task_id is not None

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def label(self) -> str:
        """For log lines: ``job 104_1 restart 2``."""
        return f"job {self.slurm_id} restart {self.restart_count}"


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return value.strip() if value is not None and value.strip() else None


def from_environ(env: Mapping[str, str]) -> JobIdentity:
    """The identity of the job whose environment ``env`` is; IdentityError names the variable."""
    raw = _get(env, "SLURM_JOB_ID")
    if raw is None:
        raise IdentityError("SLURM_JOB_ID is not set: not inside a Slurm job (submit with sbatch)")
    if not _ID_RE.fullmatch(raw):
        raise IdentityError(f"SLURM_JOB_ID={raw!r} is not a job id")
    for marker in _HET_MARKERS:
        if _get(env, marker) is not None:
            raise IdentityError(f"{marker}={env[marker]}: heterogeneous jobs are not supported by "
                                "slurmft launch (submit one homogeneous allocation)")
    array_job, array_task = _get(env, "SLURM_ARRAY_JOB_ID"), _get(env, "SLURM_ARRAY_TASK_ID")
    if (array_job is None) != (array_task is None):
        present = "SLURM_ARRAY_JOB_ID" if array_job is not None else "SLURM_ARRAY_TASK_ID"
        raise IdentityError(f"{present} is set without its partner: cannot tell which array task this is")
    if array_job is not None and array_task is not None:
        if not _ID_RE.fullmatch(array_job):
            raise IdentityError(f"SLURM_ARRAY_JOB_ID={array_job!r} is not a job id")
        if not _TASK_RE.fullmatch(array_task):
            raise IdentityError(f"SLURM_ARRAY_TASK_ID={array_task!r} is not a task index")
        slurm_id = f"{array_job}_{int(array_task)}"
    else:
        slurm_id = raw
    restart_text = _get(env, "SLURM_RESTART_COUNT") or "0"
    if not restart_text.isascii() or not restart_text.isdigit() or len(restart_text) > 9:
        raise IdentityError(f"SLURM_RESTART_COUNT={restart_text!r} is not a count")
    return JobIdentity(
        raw_job_id=raw,
        slurm_id=slurm_id,
        array_job_id=array_job,
        array_task_id=None if array_task is None else str(int(array_task)),
        restart_count=int(restart_text),
        nodes=expand_nodelist(env),
        batch_node=_get(env, "SLURMD_NODENAME") or "",
    )


def expand_nodelist(env: Mapping[str, str]) -> tuple[str, ...]:
    """``SLURM_JOB_NODELIST`` as node names (checked against ``SLURM_JOB_NUM_NODES``)."""
    expr = _get(env, "SLURM_JOB_NODELIST") or _get(env, "SLURM_NODELIST")
    if expr is None:
        raise IdentityError("SLURM_JOB_NODELIST is not set: cannot tell which nodes this job has")
    try:
        nodes = tuple(hostlist.expand_hostlist(expr))
    except hostlist.BadHostlist as exc:
        raise IdentityError(f"SLURM_JOB_NODELIST={expr!r} is not a hostlist: {exc}") from None
    if not nodes:
        raise IdentityError(f"SLURM_JOB_NODELIST={expr!r} names no node")
    bad = [n for n in nodes if not _NODE_RE.fullmatch(n)]
    if bad:
        raise IdentityError(f"SLURM_JOB_NODELIST names {bad[0]!r}, not a node name")
    if len(set(nodes)) != len(nodes):
        raise IdentityError(f"SLURM_JOB_NODELIST={expr!r} names a node twice")
    count = _get(env, "SLURM_JOB_NUM_NODES") or _get(env, "SLURM_NNODES")
    if count is not None and count != str(len(nodes)):
        raise IdentityError(f"SLURM_JOB_NUM_NODES={count} but SLURM_JOB_NODELIST={expr!r} names "
                            f"{len(nodes)} node(s)")
    return nodes
