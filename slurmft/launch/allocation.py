"""How the launcher changes ``<run_dir>/allocation.json`` (the record, its checked reader and its
atomic writer are ``slurmft.allocation``, shared with the ranks, the watcher and status).

``fence``: an active node fenced is replaced by a spare (the world keeps its size) or dropped
(the world shrinks), and the generation moves: a rank started under an older generation exits at
once. A fenced spare only leaves the spares: no rank runs there, so the generation stays.
"""

from __future__ import annotations

from dataclasses import replace

from slurmft.allocation import MAX_EVIDENCE, MAX_TEXT, Allocation, Fence


def initial(job_id: str, active: tuple[str, ...], spares: tuple[str, ...], min_nodes: int) -> Allocation:
    return Allocation(job_id=job_id, generation=0, active=active, spares=spares, fenced=(),
                      min_nodes=min_nodes)


def fence(alloc: Allocation, node: str, cause: str, time: float, evidence: list[str],
          spare: str | None) -> Allocation:
    kept = tuple(e[:MAX_TEXT] for e in evidence[:MAX_EVIDENCE])
    fenced = (*alloc.fenced, Fence(node, cause, time, kept))
    if node not in alloc.active:
        return replace(alloc, spares=tuple(n for n in alloc.spares if n != node), fenced=fenced)
    active = tuple(spare if n == node else n for n in alloc.active) if spare is not None \
        else tuple(n for n in alloc.active if n != node)
    return replace(alloc, generation=alloc.generation + 1, active=active,
                   spares=tuple(n for n in alloc.spares if n != spare), fenced=fenced)
