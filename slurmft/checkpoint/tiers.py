"""Where the node-local tier lives, and the run directory's record of what it holds.

Torch-free: ``slurmft ckpt ls`` on a login node reads the record; the job writes it.

* A node's local tier for a run is ``<local_dir>/<run name>-<hash of the run dir's path>/checkpoints``,
  with ``{node}`` in ``local_dir`` replaced by the node's name (``$SLURMD_NODENAME``, else the
  short host name), so two runs never share one and a devcluster's nodes on one machine do not
  either. Its layout is the run directory's: ``step_N/`` committed, ``step_N.tmp-<id>/`` in flight.
* A login node cannot see the nodes' disks, so after each local commit the coordinator writes
  ``<run_dir>/ckpt_tiers.json`` (atomically): for each node, the committed steps its local tier
  holds. It is what the job last knew, not a promise: a node may have died since.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from pathlib import Path

from slurmft import numbers
from slurmft.rundir import CHECKPOINTS, RunDir, atomic_write_json
from slurmft.safeio import UnsafeFileError, read_regular
from slurmft.checkpoint.manifest import parse_json_bounded

NODE_ENV = "SLURMD_NODENAME"
NODE_FIELD = "{node}"
TIERS_FORMAT = 1
MAX_TIERS_BYTES = 1 << 20
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def node_name(environ: dict[str, str] | None = None) -> str:
    """This node's name: ``$SLURMD_NODENAME`` inside a Slurm job, else the short host name."""
    env = os.environ if environ is None else environ
    return env.get(NODE_ENV) or socket.gethostname().split(".")[0]


def local_checkpoints(local_dir: str, run_root: Path, node: str) -> Path:
    """This node's ``checkpoints`` directory of the run's local tier."""
    if not node or _SAFE_NAME.search(node) or node in (".", ".."):
        raise ValueError(f"node name {node!r} cannot be part of a path")
    base = Path(local_dir.replace(NODE_FIELD, node))
    digest = hashlib.sha256(str(Path(run_root).resolve()).encode()).hexdigest()[:12]
    name = _SAFE_NAME.sub("_", Path(run_root).resolve().name) or "run"
    return base / f"{name}-{digest}" / CHECKPOINTS


def write_tier_index(run: RunDir, steps_by_node: dict[str, list[int]]) -> None:
    """Record which committed steps each node's local tier holds (the coordinator, after a commit)."""
    atomic_write_json(run.ckpt_tiers, {
        "format": TIERS_FORMAT, "updated": time.time(),
        "nodes": {node: sorted(steps) for node, steps in sorted(steps_by_node.items())}})


def read_tier_index(run: RunDir) -> dict[str, tuple[int, ...]]:
    """Node -> the local steps it held when the job last wrote the record; {} when there is none.

    The run directory is untrusted: a link, a special file, malformed or oversized JSON raises
    ValueError naming the file.
    """
    path = run.ckpt_tiers
    try:
        raw = read_regular(path, MAX_TIERS_BYTES)
    except FileNotFoundError:
        return {}
    except UnsafeFileError as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"{path}: unreadable ({exc.strerror})") from None
    data = parse_json_bounded(raw, str(path))
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict):
        raise ValueError(f"{path}: not a record of local tiers (no 'nodes' object)")
    if data.get("format") != TIERS_FORMAT:
        raise ValueError(f"{path}: format {numbers.shown(data.get('format'))}, this slurmft reads {TIERS_FORMAT}")
    out: dict[str, tuple[int, ...]] = {}
    for node, steps in data["nodes"].items():
        if (not isinstance(node, str) or _SAFE_NAME.search(node) or not isinstance(steps, list)
                or not all(numbers.count(s) is not None for s in steps)):
            raise ValueError(f"{path}: malformed entry for node {str(node)[:64]!r}")
        out[node] = tuple(sorted(set(steps)))
    return out


def holders(tiers: dict[str, tuple[int, ...]]) -> dict[int, tuple[str, ...]]:
    """Step -> the nodes whose local tier held it (sorted): built once, in one pass over every
    entry, so listing a run whose record names 140,000 steps costs what reading it costs."""
    out: dict[int, list[str]] = {}
    for node in sorted(tiers):
        for step in tiers[node]:
            out.setdefault(step, []).append(node)
    return {step: tuple(nodes) for step, nodes in out.items()}
