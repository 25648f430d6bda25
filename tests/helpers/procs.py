"""What the tests share about processes: whether a pid is still a live process (a zombie is
not), a bounded wait for a condition, and a file of JSON lines a test's process wrote."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable


def alive(pid: int) -> bool:
    """True while ``pid`` runs; False once it has ended (a zombie, or dead and being reaped) or
    is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


WAIT_S = 120.0   # a loaded 2-core box: bound every liveness wait generously


def wait_until(what: str, cond: Callable[[], object], timeout: float = WAIT_S,
               poll: float = 0.05) -> None:
    """Return once ``cond()`` is true; after ``timeout`` seconds fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)


def json_lines(path: Path) -> list[dict]:
    """Each whole line of ``path`` as JSON (a last one still being written is left for the next
    read); none when it does not exist yet."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]
