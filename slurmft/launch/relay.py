"""The node task's relay of USR2 to the ranks, whatever Slurm's proctrack plugin.

The launcher forwards the time-limit warning and a preemption's TERM to the training step as
USR2 (``signals.py``); srun passes it to slurmstepd, which signals the step through its
proctrack plugin: ``proctrack/cgroup`` and ``proctrack/linuxproc`` signal every process of the
step, ``proctrack/pgid`` only each task's process group, i.e. the node's task and torchrun (which
ignores USR2). torchrun starts every worker (a rank, or a warm client) in a session of its own,
so under pgid no rank would hear it: no emergency checkpoint, the steps since the last periodic
one lost.

So the task relays it: on each USR2 it sends one USR2 to every process group, other than its
own, of a process descended from torchrun (read from ``/proc``): each rank's group (its own
children, e.g. data-loader workers, are in it, as under cgroup they are signalled too) or each
warm client's (which passes it on to its worker: ``warmclient``), and each warm worker's: the
node's warm server is forked from torchrun's agent (``warmfork``; it stays in the task's group and
is skipped), so its workers descend from torchrun and hear it from both. Where Slurm already
signals every process, a rank hears it twice; its handler only sets a flag
(``slurmft.train.preemption``), as the launcher's re-sends every ``SLURMFT_RESIGNAL_S`` already
do: one agreement, one emergency checkpoint. Relaying everywhere, rather than only where the
plugin is ``pgid``, needs no ``scontrol`` on the nodes and fails closed: an unknown plugin or a
site's own wrapper cannot keep the signal from the ranks.

A process group read here may empty before the ``killpg`` (its rank ended); its id cannot be
reused by a stranger while any of torchrun's workers still holds it, and a pid's reuse within
the microseconds between the read and the send would need the whole pid space to cycle.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Callable

PROC = Path("/proc")


def _stat(entry: Path) -> tuple[int, int] | None:
    """(ppid, pgid) of a ``/proc/PID`` entry; None once it is gone."""
    try:
        fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def process_groups(root: int, own_pgid: int, proc: Path = PROC) -> set[int]:
    """The process groups of ``root``'s descendants other than ``own_pgid`` (and init's 0/1)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(entry)
        if stat is not None:
            children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    groups: set[int] = set()
    todo, seen = [root], {root}
    while todo:
        for pid, pgid in children.get(todo.pop(), ()):
            if pid in seen:
                continue
            seen.add(pid)
            todo.append(pid)
            if pgid not in (own_pgid, 0, 1):
                groups.add(pgid)
    return groups


def relay(root: int, signum: int = signal.SIGUSR2, own_pgid: int | None = None) -> list[int]:
    """Send ``signum`` once to each process group of ``root``'s descendants outside ours; the
    groups it reached."""
    own = os.getpgrp() if own_pgid is None else own_pgid
    reached = []
    for pgid in sorted(process_groups(root, own)):
        try:
            os.killpg(pgid, signum)
            reached.append(pgid)
        except (ProcessLookupError, PermissionError):   # ended meanwhile, or not ours
            pass
    return reached


def install(torchrun: Callable[[], int | None]) -> Callable[[], None]:
    """Relay every USR2 this process gets to the descendants of ``torchrun()`` (its pid, None
    once it ended). Call after torchrun started: a child started while the handler is in place
    would take USR2's default action (death), where it must inherit USR2 ignored. Returns the
    function that puts the previous disposition back."""

    def handler(signum: int, frame: object) -> None:
        pid = torchrun()
        if pid is None:
            return
        try:
            relay(pid, signum)
        except Exception as exc:   # a relay that fails costs the relay, never the task
            print(f"slurmft.launch.relay: could not pass signal {signum} on to torchrun's workers "
                  f"(reading {PROC}: {exc})", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGUSR2, handler)

    def restore() -> None:
        signal.signal(signal.SIGUSR2, previous if previous is not None else signal.SIG_DFL)

    return restore
