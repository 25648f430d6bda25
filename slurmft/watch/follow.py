"""Following a run's ``events.jsonl`` from a byte offset: the one reader the watcher's journal
tail (``journaltail.JournalTail``) and its ETTR gauge (``ettr.EttrTail``) are built on.

A poll costs one ``lstat`` when the journal's identity and size are unchanged, else the appended
bytes only (a weeks-long run's history is read once). The journal is untrusted: opened without
following a symlink, a regular file only, read in bounded chunks; a line past ``MAX_LINE`` is
dropped, and a journal replaced or truncated is read again from its start (``_restart``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from slurmft import safeio
from slurmft.journal import Event, parse_line

MAX_CHUNK = 8 * 1024 * 1024
MAX_LINE = 64 * 1024


class JournalFollower:
    """Calls ``_event`` for each whole line appended to ``path`` since the last ``_follow``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.identity: tuple[int, int] | None = None
        self._partial = b""
        # False when the last poll could not read the journal (it exists, but the filesystem or
        # its type refused: an NFS ESTALE, EIO, a FIFO): what was read is then older than the
        # run, and deciding on it could take a planned end for a fault (could not observe).
        self.observed = True

    def _event(self, event: Event, raw: bytes) -> None:
        """One parsed line (``raw``, without its newline)."""
        raise NotImplementedError

    def _restart(self) -> None:
        """The journal was replaced or truncated: forget what was read of it."""
        raise NotImplementedError

    def _follow(self) -> None:
        self.observed = True
        try:
            seen = os.lstat(self.path)
        except OSError as exc:
            self.observed = exc.errno == errno.ENOENT  # none yet: nothing to read is the truth
            return
        if (seen.st_dev, seen.st_ino) == self.identity and seen.st_size == self.offset:
            return
        try:
            fd, info = safeio.open_regular(self.path)
        except OSError:
            self.observed = False
            return
        try:
            identity = (info.st_dev, info.st_ino)
            if identity != self.identity or info.st_size < self.offset:
                self.identity, self.offset, self._partial = identity, 0, b""
                self._restart()
            while self.offset < info.st_size:
                chunk = os.pread(fd, min(MAX_CHUNK, info.st_size - self.offset), self.offset)
                if not chunk:
                    break
                self.offset += len(chunk)
                self._feed(chunk)
        except OSError:
            self.observed = False
        finally:
            os.close(fd)

    def _feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE:  # a line without end: drop it, keep going
            self._partial = b""
        for raw in lines:
            if not raw.strip() or len(raw) > MAX_LINE:
                continue
            try:
                event = parse_line(raw.decode("utf-8", errors="replace"))
            except (RecursionError, ValueError):
                event = None
            if event is not None:
                self._event(event, raw)
