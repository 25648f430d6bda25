"""Which nodes still beat, on two channels: ``<run_dir>/alive/<node>.json``, the file each node's
task (``slurmft.launch.task``) replaces every second, and its TCP beats to the launcher
(``beatnet``). A node is silent only when neither channel beat within the bound: a shared
filesystem stalls for seconds under load, and a fenced healthy node is a recovery that hurts.
Until a node's first TCP beat (or without a listener) its file is judged alone, with a bound of
at least ``FILE_ALONE_S``: fail closed, never fence on a filesystem's stall.

Silence is measured on the launcher's own monotonic clock, from the last time it saw a channel
change (the file's ``seq`` or ``pid``, the count of lines the listener took), never from the
time written inside it: the node's clock may be skewed, and a file from an earlier run must not
count as a beat. A node that has not beaten yet since its task was started is given
``startup_s`` (srun, python and the first write on a loaded node) before it counts as silent.
The file is untrusted: a beat is only a JSON object with an integer ``seq``; the step id it
names is used only when it is digits.
"""

from __future__ import annotations

import ipaddress
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from slurmft import safeio
from slurmft.launch.beatnet import BeatNetError, Listener
from slurmft.rundir import RunDir

MAX_BYTES = 4096
FILE_ALONE_S = 10.0   # the file's bound while it is the only channel (it was the default alone)
NO_TCP_WARN_S = 30.0  # a node that beats in its file this long without a TCP beat is said once
_STEP_RE = re.compile(r"^[0-9]{1,10}$")


@dataclass
class _Seen:
    since: float                 # monotonic: when we started looking (the task's start)
    mark: tuple[int, int] | None  # (pid, seq) of the newest beat read
    changed: float | None         # monotonic: when the mark last changed
    step_id: str | None
    ended: int | None = None      # the exit status the task wrote in its last beat
    net_mark: tuple[int, int] | None = None   # (pid, lines) the listener last had from it
    net_changed: float | None = None          # monotonic: when that last changed
    net_connected: bool = False
    warned: bool = False


def read_beat(path: Path) -> tuple[tuple[int, int], str | None, int | None] | None:
    """((pid, seq), step id, ended) of the beat at ``path``; None when there is no readable
    beat. ``ended``: the exit status of a task that ended by itself (its last beat)."""
    try:
        raw = json.loads(safeio.read_regular(path, MAX_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(raw, dict):
        return None
    seq, pid, step = raw.get("seq"), raw.get("pid"), raw.get("step_id")
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(pid, int) \
            or isinstance(pid, bool):
        return None
    ended = raw.get("ended")
    return ((pid, seq), step if isinstance(step, str) and _STEP_RE.fullmatch(step) else None,
            ended if isinstance(ended, int) and not isinstance(ended, bool) else None)


def open_channel(host: str, nodes: Iterable[str], log: Callable[[str], None]) -> Listener | None:
    """The launcher's TCP listener on ``host`` (the batch host) for ``nodes``' beats; None, said
    in one line, when it cannot be opened: every node's file is then judged alone."""
    try:
        net = Listener(host, nodes)
    except BeatNetError as exc:
        log(f"WARNING: no TCP beat channel ({exc}): a node's silence is judged on its alive file "
            f"alone, at least {FILE_ALONE_S:g} s")
        return None
    alone = " (a loopback address: another host's task cannot reach it, its file is judged " \
        "alone)" if ipaddress.ip_address(net.address.split("%")[0]).is_loopback else ""
    log(f"the nodes' tasks beat over TCP to {net.address} too (an ephemeral port, a per-run "
        f"token in their steps' environment){alone}")
    return net


class Liveness:
    def __init__(self, run_dir: RunDir, *, startup_s: float,
                 clock: Callable[[], float] = time.monotonic, net: Listener | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.run_dir = run_dir
        self.startup_s = startup_s
        self.clock = clock
        self.net = net
        self.log = log
        self._seen: dict[str, _Seen] = {}

    def expect(self, node: str) -> None:
        """Start watching ``node`` (its task was just started); a beat already there is old."""
        beat = read_beat(self.run_dir.alive(node))
        seen = _Seen(self.clock(), beat[0] if beat else None, None, None)
        heard = self.net.beat(node) if self.net is not None else None
        seen.net_mark = None if heard is None else (heard.pid, heard.count)
        self._seen[node] = seen

    def forget(self, node: str) -> None:
        self._seen.pop(node, None)

    def poll(self) -> None:
        now = self.clock()
        for node, seen in self._seen.items():
            beat = read_beat(self.run_dir.alive(node))
            if beat is not None and beat[0] != seen.mark:
                seen.mark, seen.changed = beat[0], now
                seen.step_id = beat[1] or seen.step_id
                seen.ended = beat[2] if beat[2] is not None else seen.ended
            heard = self.net.beat(node) if self.net is not None else None
            if heard is not None and (heard.pid, heard.count) != seen.net_mark:
                seen.net_mark, seen.net_changed = (heard.pid, heard.count), now
                seen.step_id = seen.step_id or heard.step_id
                seen.ended = heard.ended if heard.ended is not None else seen.ended
            if heard is not None:
                seen.net_connected = heard.connected
            if self.net is not None and self.log is not None and not seen.warned \
                    and seen.net_changed is None and seen.changed is not None \
                    and now - seen.since > NO_TCP_WARN_S:
                seen.warned = True  # a firewall, or a name that resolves elsewhere there
                self.log(f"WARNING: {node} beats in its alive file but not over TCP to "
                         f"{self.net.address}: its file is judged alone (at least "
                         f"{FILE_ALONE_S:g} s of silence before a fence)")

    def _ages(self, node: str) -> tuple[float, float | None]:
        """Seconds since the file's last beat (since expected, before the first) and since the
        last TCP beat (None: none yet)."""
        seen, now = self._seen[node], self.clock()
        file_s = now - (seen.changed if seen.changed is not None else seen.since)
        return file_s, None if seen.net_changed is None else now - seen.net_changed

    def silent_s(self, node: str) -> float:
        """Seconds since ``node`` last beat on either channel (since expected, before any)."""
        file_s, net_s = self._ages(node)
        return file_s if net_s is None else min(file_s, net_s)

    def silent(self, node: str, bound_s: float) -> bool:
        seen = self._seen[node]
        file_s, net_s = self._ages(node)
        file_bound = bound_s if net_s is not None else max(bound_s, FILE_ALONE_S)
        if seen.changed is None:
            file_bound = max(file_bound, self.startup_s)
        return file_s > file_bound and (net_s is None or net_s > bound_s)

    def describe(self, node: str) -> str:
        """Both channels' ages, for a fence's evidence."""
        seen = self._seen[node]
        file_s, net_s = self._ages(node)
        file = f"its alive file {file_s:.1f} s" + ("" if seen.changed is not None else
                                                   " (no beat yet)")
        if self.net is None:
            net = f"no TCP channel (the file alone, at least {FILE_ALONE_S:g} s)"
        elif net_s is None:
            net = f"no TCP beat yet (the file alone, at least {FILE_ALONE_S:g} s)"
        else:
            net = f"TCP {net_s:.1f} s ({'connected' if seen.net_connected else 'connection closed'})"
        return f"{file}, {net}"

    def has_beaten(self, node: str) -> bool:
        seen = self._seen[node]
        return seen.changed is not None or seen.net_changed is not None

    def ended(self, node: str) -> int | None:
        """The exit status the node's task gave as it ended by itself (None: it did not)."""
        return self._seen[node].ended

    def step_id(self, node: str) -> str | None:
        """The Slurm step id the node's task reported (digits), for fencing through Slurm."""
        seen = self._seen.get(node)
        return None if seen is None else seen.step_id
