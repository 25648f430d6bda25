"""One uninterrupted reference run per pytest run, not per xdist worker: a deterministic result
(step -> loss, sample digest) made by the first worker that needs it and read by the others from
the run's shared temp directory (the parent of every worker's ``popen-gwN`` basetemp, which
pytest cleans with the rest).

A reference is ranks importing torch and training: 10-15 s of CPU for 2-3 ranks, and the
in-allocation tests alone compare against the same two references from whichever workers they
land on. The first worker holds the key's lock while it makes the run (bounded wait for the
others); the file is written atomically, so a killed maker leaves nothing half-read.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Callable

Losses = dict[int, tuple[float, int]]

LOCK_WAIT_S = 400  # another worker's reference run: its own bound is 240 s, under load
_WORKER_DIR = re.compile(r"popen-gw\d+")


def shared_dir(run_dir: Path) -> Path | None:
    """Where every worker of this pytest run finds the references: beside the workers' own
    basetemps; None outside xdist (one process: its in-memory cache is enough)."""
    for parent in run_dir.absolute().parents:
        if _WORKER_DIR.fullmatch(parent.name):
            return parent.parent / "references"
    return None


def shared(run_dir: Path, key: tuple, make: Callable[[], Losses]) -> Losses:
    """``make()``'s result for ``key``, made once per pytest run across its workers."""
    top = shared_dir(run_dir)
    if top is None:
        return make()
    top.mkdir(exist_ok=True)
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
    path = top / f"{name}.json"
    with open(top / f"{name}.lock", "w") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"reference {path}: another worker held its lock for "
                                         f"{LOCK_WAIT_S} s") from None
                time.sleep(0.5)
        if path.exists():
            return {int(step): (loss, samples)
                    for step, (loss, samples) in json.loads(path.read_text()).items()}
        found = make()
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as fh:
            json.dump(found, fh)  # floats as repr: read back bit for bit
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return found
