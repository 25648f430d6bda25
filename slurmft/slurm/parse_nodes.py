"""Pure parsers: captured sinfo/scontrol node output -> :class:`Node` values.

22.05 has no ``scontrol --json``; its ``sinfo --json`` lists one object per node with a
lower-case ``state`` and a separate ``state_flags`` list. From 23.02 on, ``sinfo --json`` groups
nodes (``sinfo[].nodes.nodes``) and per-node detail comes from ``scontrol --json show nodes``,
whose ``nodes[].state`` is a list (``["IDLE", "DRAIN"]``; draining = base MIXED/ALLOCATED + DRAIN,
there is no DRAINING flag). Both per-node shapes share ``nodes[]`` and are parsed by one function,
and both list each node's ``partitions``.
"""

from __future__ import annotations

from typing import Any, Mapping

from slurmft.slurm.client import Node
from slurmft.slurm.jobstate import node_state
from slurmft.slurm.jsonshape import Where, load_document, records, state_names, text


def node_from_record(rec: Mapping[str, Any], where: Where) -> Node:
    name = text(rec, "name", where)
    if not name:
        raise where.key("name").fail("non-empty str", rec.get("name"))
    extra = rec.get("state_flags") or []
    if not isinstance(extra, list):
        raise where.key("state_flags").fail("list", extra)
    state, flags = node_state(
        state_names(rec.get("state"), where.key("state")),
        state_names(extra, where.key("state_flags")),
        where.key("state"),
    )
    user = rec.get("reason_set_by_user")
    return Node(
        name=name,
        state=state,
        flags=flags,
        reason=text(rec, "reason", where),
        reason_user=user if isinstance(user, str) else "",
        partitions=partitions(rec.get("partitions"), where.key("partitions")),
    )


def partitions(value: Any, where: Where) -> frozenset[str]:
    """A node's ``partitions`` (a list of names in every release's node JSON; absent or null on a
    node in no partition)."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise where.fail("list of partition names", value)
    return frozenset(v for v in value if v)


def parse_nodes(output: str, command: str) -> dict[str, Node]:
    """Nodes by name from ``sinfo --json`` (22.05) or ``scontrol --json show nodes`` (23.02+)."""
    doc = load_document(output, command, "nodes")
    nodes = [node_from_record(rec, where) for where, rec in records(doc, "nodes", command)]
    return {node.name: node for node in nodes}
