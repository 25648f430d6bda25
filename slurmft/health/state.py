"""The sweeper's memory between runs on one node: kernel-log position, remembered fatal Xids,
NVLink counters. One JSON file, written atomically; a missing or unreadable file starts fresh
(and says so), because a lost position only means re-reading the kernel log once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slurmft.rundir import atomic_write_json

STATE_VERSION = 1


class HealthState:
    def __init__(self, data: dict[str, Any] | None = None, path: Path | None = None,
                 note: str = "") -> None:
        self._data: dict[str, Any] = dict(data or {})
        self.path = path
        self.note = note  # why the state started fresh, if it did

    @classmethod
    def load(cls, path: Path) -> "HealthState":
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            return cls({}, path)
        except (OSError, ValueError) as exc:
            return cls({}, path, note=f"state file {path} unreadable ({exc}); starting fresh")
        if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
            return cls({}, path, note=f"state file {path} has another format; starting fresh")
        return cls(raw.get("data", {}), path)

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self._data[key] = value

    def save(self) -> None:
        if self.path is None:
            return
        atomic_write_json(self.path, {"version": STATE_VERSION, "data": self._data})
