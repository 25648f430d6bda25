"""In-allocation mode: the batch host's death, seen from the other nodes.

The launcher and the rendezvous store live on the batch host; its death ends training in the
allocation. Under ``sbatch --no-kill`` Slurm does not end the job then: measured on the
devcluster (22.05), the job stayed RUNNING on its other nodes with no batch script, and would
have held them to its time limit without ``slurmft watch``. So every other node's task watches
the batch host on two channels: its task's beat (``<run_dir>/alive/<batch>.json``) and the
launcher's OKs to this task's own TCP beats (``beatsend``; a refused or silent connection is
evidence). Silent on both for ``SLURMFT_NODE_SILENT_S`` (plus ``STAGGER_S`` per place in the
allocation, so that one node acts and the others find it done; the file alone, before the first
OK, for at least ``liveness.FILE_ALONE_S``) it requeues the job through ``slurmft.slurm`` excluding the batch
host (``requeue.requeue_self``: only while Slurm still runs THIS run, so a second node's try is a
no-op), and its task then stops torchrun. The requeue path takes over from the newest checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Mapping

from slurmft.launch.liveness import FILE_ALONE_S, read_beat

BATCH_ALIVE_ENV = "SLURMFT_BATCH_ALIVE_FILE"   # set by the launcher on the other nodes' steps
BATCH_NODE_ENV = "SLURMFT_BATCH_NODE"
SILENT_ENV = "SLURMFT_BATCH_SILENT_S"
PLACE_ENV = "SLURMFT_NODE_PLACE"               # this node's place among the others (0, 1, ...)
STAGGER_S = 3.0
STARTUP_S = 120.0
POLL_S = 1.0


class BatchWatch:
    """Is the batch host still beating? Silence on this node's monotonic clock, on the batch
    task's alive file and on the launcher's OKs (``acks``: how many came so far)."""

    def __init__(self, path: Path, silent_s: float, place: int,
                 clock: Callable[[], float] = time.monotonic,
                 acks: Callable[[], int] | None = None) -> None:
        self.path, self.clock, self.acks = path, clock, acks
        self.bound = silent_s + STAGGER_S * place
        self.file_bound = max(silent_s, FILE_ALONE_S) + STAGGER_S * place
        beat = read_beat(path)
        self.mark = beat[0] if beat else None
        self.since = clock()
        self.changed: float | None = None
        self.net_mark = acks() if acks is not None else 0
        self.net_changed: float | None = None

    def silent_s(self) -> float | None:
        """Seconds of silence past the bound (None: the batch host still counts as alive)."""
        beat = read_beat(self.path)
        now = self.clock()
        if beat is not None and beat[0] != self.mark:
            self.mark, self.changed = beat[0], now
        acks = self.acks() if self.acks is not None else 0
        if acks != self.net_mark:
            self.net_mark, self.net_changed = acks, now
        if beat is not None and beat[2] is not None:  # its task ended by itself: not a death
            return None
        quiet = now - (self.changed if self.changed is not None else self.since)
        if self.net_changed is None:  # no OK yet: the file alone, with the longer bound
            bound = self.file_bound if self.changed is not None else max(self.file_bound, STARTUP_S)
            return quiet if quiet > bound else None
        net_quiet = now - self.net_changed
        bound = self.bound if self.changed is not None else max(self.bound, STARTUP_S)
        return min(quiet, net_quiet) if quiet > bound and net_quiet > self.bound else None

    def describe(self) -> str:
        """Both channels' ages, for the requeue's evidence."""
        now = self.clock()
        file = f"its alive file {now - (self.since if self.changed is None else self.changed):.1f} s"
        if self.net_changed is None:
            return f"{file}, no OK from the launcher over TCP yet"
        return f"{file}, the launcher's TCP OKs {now - self.net_changed:.1f} s"


def from_environ(env: Mapping[str, str], acks: Callable[[], int] | None = None) -> BatchWatch | None:
    path, silent, place = env.get(BATCH_ALIVE_ENV), env.get(SILENT_ENV), env.get(PLACE_ENV, "0")
    if not path or not silent:
        return None
    try:
        return BatchWatch(Path(path), float(silent), int(place), acks=acks)
    except ValueError:
        return None


def requeue_job(env: Mapping[str, str], silent_s: float, detail: str = "") -> int:
    """Requeue this job, excluding the batch host (what the launcher would have done)."""
    from slurmft.launch import identity, requeue
    from slurmft.launch.journaling import Voice

    ident = identity.from_environ(env)
    batch = env.get(BATCH_NODE_ENV, "")
    run_dir = env.get("SLURMFT_RUN_DIR")
    voice = Voice(ident, Path(run_dir) if run_dir else None)
    node = env.get("SLURMD_NODENAME", "?")
    evidence = (f"no beat from the batch host for {silent_s:.1f} s (seen from {node}"
                f"{': ' + detail if detail else ''}): the launcher and the rendezvous store are gone")
    voice.log(f"{batch}: {evidence} -> requeueing the job")
    return requeue.requeue_self(requeue.slurm_client(env), ident, voice,
                                f"the batch host {batch} died", {batch: evidence} if batch else {})


def watch_forever(watch: BatchWatch, stop, on_lost: Callable[[float], None]) -> None:
    """Until ``stop`` is set: call ``on_lost(silence)`` once when the batch host goes silent."""
    while not stop.wait(POLL_S):
        silent = watch.silent_s()
        if silent is not None:
            on_lost(silent)
            return


def environ_for(batch: str, batch_alive: Path, silent_s: float, place: int) -> dict[str, str]:
    """What the launcher adds to a non-batch node's step so that its task watches the batch host."""
    return {BATCH_ALIVE_ENV: str(batch_alive), BATCH_NODE_ENV: batch, SILENT_ENV: f"{silent_s:g}",
            PLACE_ENV: str(place)}

