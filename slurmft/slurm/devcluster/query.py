"""The few controller queries the devcluster itself needs (node states, jobs, resume, cancel).

These are plain-text ``scontrol``/``squeue`` calls with a timeout, deliberately independent of
``slurmft.slurm.cli`` (the product's client): the devcluster is the test bed that client is
tested against, so it must not rely on it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from slurmft.slurm.devcluster.errors import DevClusterError

QUERY_TIMEOUT_S = 15.0


# Flags an idle node may carry and still be idle. PLANNED: the backfill pass planned the node for
# a pending job; a job that ended before the next pass (every 30 s) leaves it stale, and the
# controller starts a new job on such a node at once (measured: a 4-node job RUNNING 0.9 s after
# sbatch on two IDLE+PLANNED nodes). Read as busy, it held a reset ~27 s after a hetjob.
IDLE_FLAGS = frozenset({"PLANNED"})


@dataclass(frozen=True)
class NodeStatus:
    name: str
    state: str            # base state, e.g. IDLE, ALLOCATED, DOWN
    flags: frozenset[str]  # DRAIN, COMPLETING, NOT_RESPONDING, ...
    reason: str

    @property
    def idle(self) -> bool:
        return self.state == "IDLE" and not (self.flags - IDLE_FLAGS)

    def describe(self) -> str:
        return "+".join([self.state, *sorted(self.flags)])


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    name: str
    state: str
    elapsed: str
    nodes: str
    reason: str


def run(argv: Sequence[str], env: Mapping[str, str], timeout: float = QUERY_TIMEOUT_S) -> str:
    """Run a Slurm client command; its stdout, or DevClusterError with its stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, env=dict(env),
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise DevClusterError(f"{' '.join(argv)}: no answer within {timeout:.0f} s") from None
    except OSError as exc:
        raise DevClusterError(f"{argv[0]}: {exc.strerror}") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise DevClusterError(f"{' '.join(argv)} failed: {detail[-1] if detail else done.returncode}")
    return done.stdout


def _fields(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value two`` (scontrol -o) -> dict; a value runs to the next ``Key=``."""
    out: dict[str, str] = {}
    key = None
    for token in line.split(" "):
        name, sep, value = token.partition("=")
        if sep and name and name[0].isupper() and name.replace("_", "").isalnum():
            key = name
            out[key] = value
        elif key is not None:
            out[key] += " " + token
    return out


def parse_node_state(text: str) -> tuple[str, frozenset[str]]:
    """``IDLE*+DRAIN`` -> (``IDLE``, {``NOT_RESPONDING``, ``DRAIN``}). A trailing ``*`` on the
    base state is how scontrol marks a node that does not respond."""
    base, *flags = text.split("+")
    flag_set = set(flags)
    if base.endswith("*"):
        base = base[:-1]
        flag_set.add("NOT_RESPONDING")
    return base, frozenset(f for f in flag_set if f)


def parse_nodes(text: str) -> dict[str, NodeStatus]:
    nodes = {}
    for line in text.splitlines():
        if not line.startswith("NodeName="):
            continue
        fields = _fields(line)
        state, flags = parse_node_state(fields.get("State", "UNKNOWN"))
        nodes[fields["NodeName"]] = NodeStatus(fields["NodeName"], state, flags,
                                               fields.get("Reason", "").strip())
    return nodes


def node_states(scontrol: str, env: Mapping[str, str]) -> dict[str, NodeStatus]:
    return parse_nodes(run([scontrol, "-o", "show", "node"], env))


JOB_FORMAT = "%i|%j|%T|%M|%N|%R"


def parse_jobs(text: str) -> list[JobStatus]:
    jobs = []
    for line in text.splitlines():
        parts = line.split("|", 5)
        if len(parts) == 6:
            jobs.append(JobStatus(*parts))
    return jobs


def jobs(squeue: str, env: Mapping[str, str]) -> list[JobStatus]:
    return parse_jobs(run([squeue, "-h", "-o", JOB_FORMAT], env))


def cancel(scancel: str, job_ids: Sequence[str], env: Mapping[str, str]) -> None:
    if job_ids:
        run([scancel, *job_ids], env)


def resume_node(scontrol: str, node: str, env: Mapping[str, str]) -> None:
    run([scontrol, "update", f"NodeName={node}", "State=RESUME"], env)
