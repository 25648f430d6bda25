"""The sweeper's memory between runs on one node: kernel-log position, remembered fatal Xids,
the checks behind its drain, the GPUs it saw, NVLink and InfiniBand counters. One JSON file,
written atomically.

A missing file is the node's first sweep. A file that cannot be read, or whose record does not
check field by field (``state_check``), is never taken for a fresh start: the sweep's memory of
fatal events is lost, so the state says so (``unreadable``), the sweep keeps every drain it
cannot prove it may lift (``slurmft/sweep/run.py``), and the file is kept as it was: the first
save hard-links it to ``<name>.unreadable`` before the new state replaces it (a save that fails
leaves it in place, still unreadable, so the next sweep fails closed again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from slurmft.health import state_check
from slurmft.rundir import atomic_write_json, fsync_dir
from slurmft.safeio import read_regular

STATE_VERSION = 1
MAX_STATE_BYTES = 16 * 2**20  # far above any real state (32 Xids, a few hundred counters)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _read(path: Path) -> dict[str, Any]:
    """The record in ``path``; raises OSError or ValueError saying what is wrong with it."""
    raw = read_regular(path, MAX_STATE_BYTES)  # no link followed, no FIFO waited on
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
        raise ValueError(f"not a version {STATE_VERSION} sweep state")
    data = doc.get("data")
    problem = state_check.problem(data)
    if problem or not isinstance(data, dict):
        raise ValueError(problem)
    return dict(data)


class HealthState:
    def __init__(self, data: dict[str, Any] | None = None, path: Path | None = None,
                 note: str = "", unreadable: str = "") -> None:
        self._data: dict[str, Any] = dict(data or {})
        self.path = path
        self.note = note  # what the sweep's report should say about its memory
        self.unreadable = unreadable  # why the file at ``path`` is not trusted ("" if it is)

    @property
    def aside(self) -> Path | None:
        """Where an unreadable state file is kept, as it was, once a new state is saved."""
        return None if self.path is None else Path(f"{self.path}.unreadable")

    @classmethod
    def load(cls, path: Path) -> "HealthState":
        try:
            return cls(_read(path), path)
        except FileNotFoundError:
            return cls({}, path)
        except (OSError, ValueError) as exc:
            why = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
            why = " ".join(why.split())[:200]
            return cls({}, path, note=f"state file {path} unreadable ({why})", unreadable=why)

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self._data[key] = value

    def _keep_unreadable(self) -> None:
        """Hard-link the unreadable file to ``aside`` (replacing an older one): kept as it was."""
        assert self.path is not None and self.aside is not None
        tmp = Path(f"{self.aside}.tmp-{os.getpid()}")
        try:
            tmp.unlink(missing_ok=True)
            os.link(self.path, tmp, follow_symlinks=False)
            os.replace(tmp, self.aside)
        except FileNotFoundError:
            if os.path.lexists(self.path):
                raise
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.path.parent)

    def save(self) -> None:
        if self.path is None:
            return
        if self.unreadable:
            self._keep_unreadable()  # raises (and nothing is replaced) if it cannot be kept
        atomic_write_json(self.path, {"version": STATE_VERSION, "data": self._data})
        self.unreadable = ""
