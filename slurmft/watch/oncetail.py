"""Where ``slurmft watch --once`` left off in each run's journal: ``<run_dir>/watch/journal_tail.json``.

A cron line runs one cycle per invocation; without this every invocation would read every
journal from its first byte. The file holds the journal's identity (device, inode), the offset
of the last whole line read, and the lines the watcher's journal summary is made of (every line
but the losses, and the newest loss; ``JournalTail.kept_lines``), so the next invocation
rebuilds the summary from those lines and reads only what was appended since. It is a cache: a
missing, damaged or foreign file (the run dir is the user's) means one read from the start,
never a different decision. Written atomically, and only when the offset moved.
"""

from __future__ import annotations

import json
from pathlib import Path

from slurmft.rundir import RunDir, atomic_write_json
from slurmft.watch.runview import MAX_KEPT_LINES, MAX_LINE, JournalTail, read_regular

TAIL_FILE = "journal_tail.json"
TAIL_VERSION = 1
MAX_TAIL_FILE = 16 * 1024 * 1024


def tail_path(run_dir: RunDir) -> Path:
    return run_dir.watch_state.parent / TAIL_FILE


def save_tail(tail: JournalTail, path: Path) -> None:
    """Write (atomically) where ``tail`` is and the lines its summary is made of."""
    if tail.identity is None:
        return
    atomic_write_json(path, {
        "version": TAIL_VERSION, "dev": tail.identity[0], "ino": tail.identity[1],
        "offset": tail.complete_offset, "events_read": tail.summary.events_read,
        "lines": [raw.decode("utf-8", errors="replace") for raw in tail.kept_lines()]})


def load_tail(tail: JournalTail, path: Path) -> bool:
    """Carry ``tail`` on from a saved place; False (and a read from the start on its next poll)
    when there is none or the file is not one."""
    data = read_regular(path, MAX_TAIL_FILE)
    try:
        saved = json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return False
    if not isinstance(saved, dict) or saved.get("version") != TAIL_VERSION:
        return False
    numbers = [saved.get(k) for k in ("dev", "ino", "offset", "events_read")]
    lines = saved.get("lines")
    if (not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers)
            or not isinstance(lines, list) or len(lines) > MAX_KEPT_LINES + 1
            or not all(isinstance(x, str) and "\n" not in x and len(x) <= MAX_LINE for x in lines)):
        return False
    dev, ino, offset, events_read = (int(v) for v in numbers)  # type: ignore[arg-type]
    tail.restore((dev, ino), offset, [x.encode() for x in lines])
    tail.summary.events_read = events_read
    return True
