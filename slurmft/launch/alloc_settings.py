"""In-allocation mode's settings: which of the allocation's nodes train, which wait as hot
spares, and the bounds of recovery inside the allocation. Read once from the environment and
validated against the allocation; a bad value is a SettingsError naming the variable (the
launcher gives up with 86 before anything is started).

  SLURMFT_SPARE_NODES=K     K >= 0 nodes wait as hot spares; K >= 1 turns the mode on
  SLURMFT_IN_ALLOCATION=1   turns it on with K = 0 (shrink only)
  SLURMFT_MIN_NODES=M       smallest world in nodes (default: the active node count: no shrink)
  SLURMFT_NODE_SILENT_S     a node whose task beat on neither channel (its alive file, TCP to
                            the launcher: ``liveness``) for this long is fenced (5)
  SLURMFT_NODE_POLL_S       how often the launcher asks Slurm for its nodes' states, to fence a
                            node drained, DOWN or FAILed while its task still beats
                            (``nodestate``; 10, at least 2: one query of the controller each)
  SLURMFT_ALLOC_RESTARTS    restarts in place without checkpoint progress before exit 86 (3)
  SLURMFT_SPARE_REFILL=1    once fewer than K spares wait, ask Slurm for one-node spare jobs
                            outside the allocation (``refill``; 0 by default: they are charged
                            to the user's share)
  SLURMFT_SPARE_SBATCH      those jobs' own sbatch options (``--exclusive`` by default)

Warm workers (``SLURMFT_WARM_WORKERS``) are the launcher's setting in both modes (``settings``).

The batch host is always active (it hosts the rendezvous store, and its death ends the job);
the spares are the allocation's last K other nodes, in Slurm's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from slurmft.launch import refill
from slurmft.launch.identity import JobIdentity
from slurmft.launch.settings import SettingsError, _number

MIN_NODE_SILENT_S = 2.0   # the node task beats every second: less would fence a busy node
# Two channels (file and TCP): a filesystem's stall alone fences nobody, so the bound can be
# short; the file alone (no TCP beat from a node yet) still needs liveness.FILE_ALONE_S.
DEFAULT_NODE_SILENT_S = 5.0
DEFAULT_ALLOC_RESTARTS = 3
DEFAULT_NODE_POLL_S = 10.0
MIN_NODE_POLL_S = 2.0     # every job's launcher asking more often loads a shared controller


@dataclass(frozen=True)
class AllocSettings:
    active: tuple[str, ...]     # the nodes that train first, batch host first
    spares: tuple[str, ...]     # hot spares, in the order they are used
    min_nodes: int
    node_silent_s: float
    alloc_restarts: int
    node_poll_s: float = DEFAULT_NODE_POLL_S
    refill: bool = False                # keep len(spares) spares, from outside once used
    spare_sbatch: tuple[str, ...] = ()  # the spare jobs' own sbatch options


def from_environ(env: Mapping[str, str], identity: JobIdentity) -> AllocSettings | None:
    """The mode's settings, or None when it is off (neither variable turns it on)."""
    flag = (env.get("SLURMFT_IN_ALLOCATION") or "").strip()
    if flag not in ("", "0", "1"):
        raise SettingsError(f"SLURMFT_IN_ALLOCATION={flag!r} must be 0 or 1")
    nodes = identity.nodes
    spares_n = int(_number(env, "SLURMFT_SPARE_NODES", 0, minimum=0, maximum=max(0, len(nodes) - 1),
                           integer=True)) if len(nodes) > 1 else \
        int(_number(env, "SLURMFT_SPARE_NODES", 0, minimum=0, maximum=0, integer=True))
    wants_refill = refill.enabled(env)
    if spares_n == 0 and flag != "1" and not wants_refill:
        return None
    if wants_refill and spares_n == 0:
        raise SettingsError("SLURMFT_SPARE_REFILL=1 keeps SLURMFT_SPARE_NODES spares waiting: set "
                            "SLURMFT_SPARE_NODES to 1 or more")
    batch = identity.batch_node if identity.batch_node in nodes else nodes[0]
    others = [n for n in nodes if n != batch]
    spares = tuple(others[len(others) - spares_n:]) if spares_n else ()
    active = (batch, *[n for n in others if n not in spares])
    return AllocSettings(
        active=active,
        spares=spares,
        min_nodes=int(_number(env, "SLURMFT_MIN_NODES", len(active), minimum=1, maximum=len(active),
                              integer=True)),
        node_silent_s=_number(env, "SLURMFT_NODE_SILENT_S", DEFAULT_NODE_SILENT_S,
                              minimum=MIN_NODE_SILENT_S, maximum=3600),
        alloc_restarts=int(_number(env, "SLURMFT_ALLOC_RESTARTS", DEFAULT_ALLOC_RESTARTS, minimum=0,
                                   maximum=1000, integer=True)),
        node_poll_s=_number(env, "SLURMFT_NODE_POLL_S", DEFAULT_NODE_POLL_S,
                            minimum=MIN_NODE_POLL_S, maximum=3600),
        refill=wants_refill,
        spare_sbatch=refill.sbatch_options(env) if wants_refill else (),
    )
