"""Recording what the watcher saw, one JSON line per run per cycle (``slurmft watch --record``).

A record holds the job and nodes as Slurm reported them, the run's heartbeats and DONE marker,
the journal's byte offset at that moment, and what the watcher remembered: enough to run the
detectors again on the same input. The project's detector tests replay records captured from
devcluster runs (tests/fixtures/watch/).
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from slurmft.slurm.client import Job, JobState, Node, NodeState
from slurmft.watch.detect import Memory, RunObservation
from slurmft.watch.runview import Beat, JournalTail


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def job_to_json(job: Job) -> dict[str, Any]:
    data = dataclasses.asdict(job)
    data["state"] = job.state.value
    data["flags"] = sorted(job.flags)
    data["nodes"], data["excluded_nodes"] = list(job.nodes), list(job.excluded_nodes)
    for key in ("submit_time", "eligible_time", "start_time", "end_time", "time_limit_end"):
        data[key] = _ts(getattr(job, key))
    for key in ("work_dir", "run_dir"):
        data[key] = str(data[key]) if data[key] is not None else None
    return data


def job_from_json(data: dict[str, Any]) -> Job:
    values = dict(data)
    values["state"] = JobState(values["state"])
    values["flags"] = frozenset(values["flags"])
    for key in ("nodes", "excluded_nodes"):
        values[key] = tuple(values[key])
    for key in ("submit_time", "eligible_time", "start_time", "end_time", "time_limit_end"):
        stamp = values.get(key)  # time_limit_end: absent from records made before it existed
        values[key] = datetime.fromtimestamp(stamp, tz=timezone.utc) if stamp is not None else None
    for key in ("work_dir", "run_dir"):
        values[key] = Path(values[key]) if values[key] is not None else None
    return Job(**values)


def node_to_json(node: Node) -> dict[str, Any]:
    return {"name": node.name, "state": node.state.value, "flags": sorted(node.flags),
            "reason": node.reason, "reason_user": node.reason_user,
            "partitions": sorted(node.partitions)}


def node_from_json(data: dict[str, Any]) -> Node:
    return Node(data["name"], NodeState(data["state"]), frozenset(data["flags"]), data["reason"],
                data["reason_user"], frozenset(data.get("partitions", ())))  # older records: none


def observation_to_json(obs: RunObservation, memory: Memory, journal_offset: int) -> dict[str, Any]:
    return {
        "now": obs.now,
        "job_id": obs.job_id,
        "job": job_to_json(obs.job) if obs.job is not None else None,
        "nodes": [node_to_json(n) for n in obs.nodes.values()],
        "beats": [dataclasses.asdict(b) for b in (obs.beats or {}).values()],
        "done": obs.done,
        "journal_offset": journal_offset,
        "memory": {"last_restart_count": memory.last_restart_count,
                   "last_nodes": list(memory.last_nodes), "step_times": list(memory.step_times),
                   "beat_gap_s": memory.beat_gap_s, "beats_seen": memory.beats_seen,
                   "node_history": {n: list(h) for n, h in memory.node_history.items()}},
    }


def observation_from_json(data: dict[str, Any], journal: Path) -> tuple[RunObservation, Memory]:
    """Rebuild a recorded observation; ``journal`` is a copy of the run's events.jsonl, read up
    to the recorded offset."""
    tail = JournalTail(journal)
    tail.poll()
    if tail.offset > data["journal_offset"]:
        tail = _tail_upto(journal, data["journal_offset"])
    nodes = {n["name"]: node_from_json(n) for n in data["nodes"]}
    beats = {b["node"]: _beat_from_json(b) for b in data["beats"]}
    job = job_from_json(data["job"]) if data["job"] is not None else None
    m = data["memory"]
    if "step_times" in m:
        steps, gap, seen = tuple(m["step_times"]), m["beat_gap_s"], m["beats_seen"]
    else:  # recorded by an older watcher: its longest step and beat gap
        steps = (m["max_step_s"],) if m.get("max_step_s") is not None else ()
        gap, seen = m.get("max_beat_gap_s"), bool(beats)
    memory = Memory(m["last_restart_count"], tuple(m["last_nodes"]), steps,
                    {n: tuple(h) for n, h in m["node_history"].items()}, gap, seen)
    return RunObservation(data["job_id"], job, nodes, tail.summary, beats, data["done"],
                          data["now"]), memory


def _beat_from_json(data: dict[str, Any]) -> Beat:
    values = dict(data)
    if "recent_step_s" in values:  # recorded by an older watcher
        values["step_s"] = values.pop("recent_step_s")
    return Beat(**values)


def _tail_upto(journal: Path, offset: int) -> JournalTail:
    tail = JournalTail(journal)
    tail._feed(journal.read_bytes()[:offset])
    return tail


class Recorder:
    """Appends one record per observation to ``path`` (one JSON line, flushed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")

    def __call__(self, obs: RunObservation, memory: Memory, journal_offset: int) -> None:
        self._fh.write(json.dumps(observation_to_json(obs, memory, journal_offset)) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
