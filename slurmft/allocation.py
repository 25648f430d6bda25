"""``<run_dir>/allocation.json``: the in-allocation launcher's record of who trains where.

Written by the launcher on the batch host only (``write``: atomic, temp + fsync + rename), read
by the ranks (a newer ``generation`` than the one they started with: exit at once), by ``slurmft
watch`` (a fenced node's death is expected, a spare's is not training's; fenced nodes are
excluded from the next requeue) and by ``slurmft status`` (the spares). The file sits in the
user's run dir: every reader treats it as untrusted input (``read``/``parse``: a regular file, no
link followed, bounded, every field checked; a field that does not check is an
``AllocationError`` naming it, never a guess).

The contract (issue 27, decided between the lanes)::

    {"version": 1, "job_id": "<array-aware id>", "generation": G, "active": [nodes...],
     "spares": [nodes...], "fenced": [{"node": n, "cause": c, "time": epoch_s,
     "evidence": [...]}], "min_nodes": M,
     "spare_jobs": [{"job_id": "<id>", "node": "<node, or empty while it waits in the queue>"}]}

``spare_jobs`` (optional) are the one-node jobs the launcher asked Slurm for once the job's own
spares were used (``slurmft.launch.refill``): a running one's node is among ``spares`` (or, once
it took a place, ``active``) though it is not in the job's own allocation.

torch-free and Slurm-free: both sides import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from slurmft import numbers, safeio
from slurmft.rundir import RunDir, atomic_write_json

VERSION = 1
MAX_BYTES = 1024 * 1024       # a few thousand nodes with their evidence
MAX_NODES = 65536
MAX_EVIDENCE = 64             # evidence lines kept per fenced node
MAX_TEXT = 1000               # characters per cause or evidence line
# A node name as Slurm spells one (slurmft.slurm.validate's rule, kept here so that this module
# stays free of the Slurm package): letters, digits, '.', '_', '-'.
_NODE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class AllocationError(ValueError):
    """allocation.json cannot be used: the message names the file or the field that is wrong."""


@dataclass(frozen=True)
class Fence:
    """A node the launcher fenced: its tasks were signalled, the job never uses it again."""

    node: str
    cause: str
    time: float | None
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpareJob:
    """A spare from outside the allocation: its own one-node job, and its node once it runs."""

    job_id: str
    node: str = ""


@dataclass(frozen=True)
class Allocation:
    job_id: str
    generation: int
    active: tuple[str, ...]
    spares: tuple[str, ...] = ()
    fenced: tuple[Fence, ...] = ()
    min_nodes: int | None = None
    spare_jobs: tuple[SpareJob, ...] = ()

    @property
    def spare_job_ids(self) -> frozenset[str]:
        return frozenset(j.job_id for j in self.spare_jobs)

    def spare_job_of(self, node: str) -> str | None:
        """The spare job whose allocation ``node`` is (None: the training job's own node)."""
        return next((j.job_id for j in self.spare_jobs if j.node == node), None)

    @property
    def fenced_nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f.node for f in self.fenced))

    def for_job(self, ids) -> bool:
        """Whether this record is the one of the job known by ``ids`` (one id or several: an
        array task is ``<array>_<task>`` to Slurm and its raw number to its processes)."""
        return self.job_id in ({ids} if isinstance(ids, str) else set(ids))

    def to_json(self) -> dict[str, Any]:
        out = {"version": VERSION, "job_id": self.job_id, "generation": self.generation,
               "active": list(self.active), "spares": list(self.spares),
               "fenced": [{"node": f.node, "cause": f.cause, "time": f.time,
                           "evidence": list(f.evidence)} for f in self.fenced],
               "min_nodes": self.min_nodes}
        if self.spare_jobs:   # only with SLURMFT_SPARE_REFILL: the record is otherwise as before
            out["spare_jobs"] = [{"job_id": j.job_id, "node": j.node} for j in self.spare_jobs]
        return out


def job_ids(env: Mapping[str, str]) -> set[str]:
    """The ids a record may name the job of a process with environment ``env`` by: the
    launcher's array-aware ``SLURMFT_JOB_ID`` and Slurm's raw ``SLURM_JOB_ID``."""
    return {v for v in (env.get("SLURMFT_JOB_ID"), env.get("SLURM_JOB_ID")) if v}


def _node(value: Any, field: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 64 or not set(value) <= _NODE_CHARS \
            or value[0] in "._-":
        raise AllocationError(f"allocation.json: {field} is not a node name: {numbers.shown(value)}")
    return value


def _nodes(record: Mapping[str, Any], field: str) -> tuple[str, ...]:
    value = record.get(field, [])
    if not isinstance(value, list) or len(value) > MAX_NODES:
        raise AllocationError(f"allocation.json: {field} must be a list of node names")
    names = tuple(_node(v, f"{field}[{i}]") for i, v in enumerate(value))
    if len(set(names)) != len(names):
        raise AllocationError(f"allocation.json: {field} names a node twice")
    return names


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise AllocationError(f"allocation.json: {field} must be a string: {numbers.shown(value)}")
    return value[:MAX_TEXT]


def _fence(value: Any, index: int) -> Fence:
    where = f"fenced[{index}]"
    if not isinstance(value, dict):
        raise AllocationError(f"allocation.json: {where} must be an object")
    evidence = value.get("evidence", [])
    if isinstance(evidence, str):
        evidence = [evidence]
    if not isinstance(evidence, list):
        raise AllocationError(f"allocation.json: {where}.evidence must be a list of strings")
    when = value.get("time")
    if when is not None and numbers.unix_time(when) is None:
        raise AllocationError(f"allocation.json: {where}.time is not a unix time: {numbers.shown(when)}")
    return Fence(node=_node(value.get("node"), f"{where}.node"),
                 cause=_text(value.get("cause", ""), f"{where}.cause"),
                 time=numbers.unix_time(when),
                 evidence=tuple(_text(e, f"{where}.evidence[{i}]")
                                for i, e in enumerate(evidence[:MAX_EVIDENCE])))


def _job_id(value: Any, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value) \
            or len(str(value)) > 64:
        raise AllocationError(f"allocation.json: {field} is not a job id: {numbers.shown(value)}")
    return str(value)


def _spare_jobs(record: Mapping[str, Any]) -> tuple[SpareJob, ...]:
    value = record.get("spare_jobs", [])
    if not isinstance(value, list) or len(value) > MAX_NODES:
        raise AllocationError("allocation.json: spare_jobs must be a list")
    jobs = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise AllocationError(f"allocation.json: spare_jobs[{i}] must be an object")
        node = item.get("node", "")
        jobs.append(SpareJob(_job_id(item.get("job_id"), f"spare_jobs[{i}].job_id"),
                             "" if node == "" else _node(node, f"spare_jobs[{i}].node")))
    if len({j.job_id for j in jobs}) != len(jobs):
        raise AllocationError("allocation.json: spare_jobs names a job twice")
    placed = [j.node for j in jobs if j.node]
    if len(set(placed)) != len(placed):
        raise AllocationError("allocation.json: spare_jobs names a node twice")
    return tuple(jobs)


def parse(record: Any) -> Allocation:
    """The record as an ``Allocation``, every field checked (``AllocationError`` names the first
    that is wrong). A newer version is refused, not guessed at."""
    if not isinstance(record, dict):
        raise AllocationError("allocation.json: not a JSON object")
    version = numbers.whole(record.get("version"), 1)
    if version is None:
        raise AllocationError("allocation.json: version is not a positive integer: "
                              f"{numbers.shown(record.get('version'))}")
    if version > VERSION:
        raise AllocationError(f"allocation.json: version {version} is newer than this slurmft "
                              f"reads ({VERSION})")
    job = _job_id(record.get("job_id"), "job_id")
    generation = numbers.count(record.get("generation"))
    if generation is None:
        raise AllocationError("allocation.json: generation is not a count: "
                              f"{numbers.shown(record.get('generation'))}")
    fenced = record.get("fenced", [])
    if not isinstance(fenced, list) or len(fenced) > MAX_NODES:
        raise AllocationError("allocation.json: fenced must be a list")
    min_nodes = record.get("min_nodes")
    if min_nodes is not None and numbers.whole(min_nodes, 1) is None:
        raise AllocationError(f"allocation.json: min_nodes is not a positive integer: {numbers.shown(min_nodes)}")
    active, spares = _nodes(record, "active"), _nodes(record, "spares")
    if set(active) & set(spares):
        raise AllocationError("allocation.json: a node is both active and a spare")
    return Allocation(job_id=job, generation=generation, active=active, spares=spares,
                      fenced=tuple(_fence(f, i) for i, f in enumerate(fenced)), min_nodes=min_nodes,
                      spare_jobs=_spare_jobs(record))


def read(run_dir: RunDir) -> Allocation | None:
    """The run's allocation record; None when there is none (the job is not in in-allocation
    mode). A file that is there but is not a regular file, is too big, cannot be read or does not
    check: ``AllocationError`` naming it (what the reader cannot observe it must not guess)."""
    target = run_dir.allocation
    try:
        data = safeio.read_regular(target, MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:  # safeio's UnsafeFileError (a link, a FIFO, too big) included
        raise AllocationError(f"{target}: cannot be read: {exc}") from None
    try:
        record = numbers.loads(data)
    except ValueError as exc:
        raise AllocationError(f"{target}: not JSON: {exc}") from None
    return parse(record)


def write(run_dir: RunDir, allocation: Allocation) -> None:
    """Write the record atomically (the launcher, on the batch host only)."""
    parse(allocation.to_json())  # what is written is what every reader accepts
    atomic_write_json(run_dir.allocation, allocation.to_json())
