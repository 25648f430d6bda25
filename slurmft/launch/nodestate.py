"""In-allocation mode: Slurm's own word on the allocation's nodes, for the supervisor's fences.

A node can be unfit for training while its task still beats: the health sweeper drained it for
a failing check (``slurmft: <check>: ...``), an admin drained it, Slurm set it DOWN or FAIL.
Liveness (``liveness``) cannot see that; Slurm can. Every ``SLURMFT_NODE_POLL_S`` (``POLL_S`` by
default) a daemon thread asks for the allocation's nodes (``SlurmClient.nodes``: one ``scontrol
show nodes`` / ``sinfo``, bounded by the client's timeout and retries) and keeps the newest answer; the supervisor's loop reads it
(``unfit``) and never waits on the controller itself.

  DOWN (base state), DRAIN (draining or drained), FAIL -> unfit, with Slurm's reason as evidence

A drain means "finish what runs": a node drained by anyone but slurmft's sweeper (an admin's
maintenance, ``NODE_DRAINED``) that trains (``waits``: the active nodes) is reported unfit only
once a checkpoint newer than the newest one at the drain's first sight has committed (the
journal's ``checkpoint_committed``, read by ``inplace``), so the fence loses no step, or when none
did within the bound: the watcher's own rule for the requeue path (``watch.detect_nodes.
admin_drain``) with its defaults, twice the run's median checkpoint interval seen here, at least
120 s, and 3600 s while fewer than two commits were seen. The sweeper's drain (a failing health
check), DOWN and FAIL are unfit at once, and so is a drained spare (it trains nothing).

An answer that cannot be had is "could not observe": nothing is fenced on it, one warning per
streak of failures. A node absent from the answer is unknown, never unfit. Which unfit node is
fenced (an active one other than the batch host, a spare), and how, is the supervisor's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Collection, Mapping, Sequence

from slurmft.slurm.client import Node, SlurmError
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect_nodes import drain_bound_of
from slurmft.watch.findings import SWEEPER_PREFIX

POLL_S = 10.0

# The cause journaled for each kind of unfitness (the watcher's names for the same states).
NODE_DOWN = "node_down"
NODE_UNHEALTHY = "node_unhealthy"   # drained by slurmft's health sweeper
NODE_DRAINED = "node_drained"       # drained by anyone else (an admin, another tool)
NODE_FAIL = "node_fail"


@dataclass(frozen=True)
class Unfit:
    node: str
    cause: str
    evidence: str


def unfit(node: Node) -> Unfit | None:
    """Why Slurm says ``node`` must not train this job (None: nothing said against it). Pure."""
    reason = "".join(c if c.isprintable() else "?" for c in node.reason[:200]) or "no reason"
    flags = ",".join(sorted(node.flags))
    shown = f"Slurm shows {node.name} {node.state.value}{'+' + flags if flags else ''} ({reason})"
    if "FAIL" in node.flags:
        return Unfit(node.name, NODE_FAIL, shown)
    if node.down:
        return Unfit(node.name, NODE_DOWN, shown)
    if node.drained:
        cause = NODE_UNHEALTHY if node.reason.startswith(SWEEPER_PREFIX) else NODE_DRAINED
        return Unfit(node.name, cause, shown)
    return None


class NodeStates:
    """The newest answer of a background poll of Slurm's node table for ``names``."""

    def __init__(self, client, names: Callable[[], Sequence[str]], log: Callable[[str], None],
                 *, poll_s: float = POLL_S) -> None:
        self.client, self.names, self.log, self.poll_s = client, names, log, poll_s
        self._lock = threading.Lock()
        self._newest: Mapping[str, Node] = {}
        self._failing = False
        self._drains: dict[str, tuple[float, int | None]] = {}  # node -> (first seen, newest commit then)
        self._commits: list[tuple[float, int]] = []   # (monotonic, step) of the commits seen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.client is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, daemon=True, name="slurmft-nodestate")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll_once()

    def poll_once(self) -> None:
        names = list(self.names())
        if not names:
            return
        started = time.monotonic()
        try:
            found = self.client.nodes(names)
        except SlurmError as exc:
            if not self._failing:
                self.log(f"WARNING: could not read the nodes' state from Slurm ({exc}); nothing is "
                         "fenced on Slurm's word until it answers")
            self._failing = True
            return
        if self._failing:
            self.log(f"Slurm answers again on the nodes' state ({time.monotonic() - started:.1f} s)")
        self._failing = False
        with self._lock:
            self._newest = dict(found)

    def unfit(self, names: Sequence[str], *, committed: int | None = None,
              waits: Collection[str] = ()) -> list[Unfit]:
        """The nodes of ``names`` the newest answer says are unfit, in ``names``' order; an
        admin's drain of a node of ``waits`` only after a checkpoint newer than the one
        ``committed`` (the newest so far) at its first sight, or the bound (module docstring)."""
        with self._lock:
            newest = self._newest
        now = time.monotonic()
        if committed is not None and (not self._commits or committed > self._commits[-1][1]):
            self._commits = [*self._commits[-19:], (now, committed)]
        found = []
        for name in names:
            node = newest.get(name)
            why = unfit(node) if node is not None else None
            if why is not None and why.cause == NODE_DRAINED and name in waits:
                why = self._after_checkpoint(why, committed, now)
            elif why is None and node is not None:
                self._drains.pop(name, None)  # undrained: a later drain waits afresh
            if why is not None:
                found.append(why)
        return found

    def drain_bound(self) -> float:
        """Longest an admin-drained node trains on for its checkpoint (the watcher's rule)."""
        return drain_bound_of([t for t, _ in self._commits], WatchConfig())

    def _after_checkpoint(self, why: Unfit, committed: int | None, now: float) -> Unfit | None:
        if why.node not in self._drains:
            self._drains[why.node] = (now, committed)
            self.log(f"{why.evidence}: an admin's drain: {why.node} trains on until the next "
                     f"checkpoint commits (at most {self.drain_bound():.0f} s), then it is fenced")
        since, before = self._drains[why.node]
        if committed is not None and (before is None or committed > before):
            return replace(why, evidence=f"{why.evidence}: an admin's drain; checkpoint step "
                           f"{committed} committed after it was seen: fenced at a fresh checkpoint")
        waited, bound = now - since, self.drain_bound()
        if waited > bound:
            return replace(why, evidence=f"{why.evidence}: an admin's drain; no checkpoint "
                           f"committed in the {waited:.0f} s since it was seen (bound {bound:.0f} s)")
        return None
