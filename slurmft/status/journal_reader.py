"""The bounded reader of a run's journal, ``events.jsonl``, for ``slurmft status`` and its
siblings (:func:`read_journal`): the file is the run owner's, so it is opened without following a
link or blocking on a FIFO, must be a regular file, and is read up to a bound."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from slurmft.journal import Event, parse_line

# A weeks-long run journals one loss line (~150 bytes) per step: this bounds about 3 M steps.
MAX_JOURNAL_BYTES = 512 * 1024 * 1024
MAX_LINE = 64 * 1024


class JournalUnreadable(ValueError):
    """The run dir's journal is missing, not a regular file, or cannot be read."""


def read_journal(path: Path) -> list[Event]:
    """Every event of ``events.jsonl`` in file order. The file is the run owner's: it is opened
    without following a symlink or blocking on a FIFO, must be a regular file, and is read up to
    ``MAX_JOURNAL_BYTES``; a line that is not an event is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise JournalUnreadable(f"{path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise JournalUnreadable(f"{path} is not a regular file")
        if info.st_size > MAX_JOURNAL_BYTES:
            raise JournalUnreadable(f"{path} is {info.st_size} bytes, more than the "
                                    f"{MAX_JOURNAL_BYTES} this reads")
        events = []
        for raw in fh:
            if len(raw) > MAX_LINE or not raw.strip():
                continue
            try:
                event = parse_line(raw.decode("utf-8", errors="replace"))
            except RecursionError:
                event = None
            if event is not None:
                events.append(event)
    return events
