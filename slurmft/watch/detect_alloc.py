"""A job in in-allocation mode (issue 27), as the watcher must see it: its launcher recovers a
node's death inside the allocation (a spare takes the node's place, or the world shrinks), so
that death is expected and the watcher leaves the run alone: never a requeue or a hold for a node
the launcher fenced, or for a spare, which trains nothing. Pure functions, as in ``detect.py``.

What the launcher did comes from two places, both the job's own and untrusted: its journal
events (``where: "allocation"``: a ``recovery_action`` ``fence`` names the fenced nodes) and
``allocation.json`` (active nodes, spares, fenced nodes), read only when the run dir changed.
A node of the job that Slurm shows DOWN and that the launcher has not fenced is the launcher's
to handle first: the watcher waits ``allocation_grace_s`` from when it first saw it so, then
recovers as it would any job (a launcher that did not act is no reason to leave a run broken).
The batch host is the exception: its death ends the job (the rendezvous store and the launcher
live there), so it goes the requeue path at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slurmft import journal
from slurmft.watch.findings import RunObservation


@dataclass(frozen=True)
class AllocView:
    """A running job's in-allocation state this cycle: the nodes its launcher fenced in the
    current segment (with the evidence it journaled), its spares, its active nodes (empty when
    no ``allocation.json`` of the job was read), and when it last restarted inside the allocation
    (None: not since the segment started)."""

    fenced: frozenset[str]
    spares: frozenset[str] = frozenset()
    active: frozenset[str] = frozenset()
    restarted_at: float | None = None
    evidence: dict[str, str] = field(default_factory=dict)


def allocation_view(obs: RunObservation) -> AllocView | None:
    """The job's in-allocation view, or None when it is not in in-allocation mode (no
    ``allocation.json`` naming it, no launcher event of its current segment in the journal)."""
    job = obs.job
    if job is None:
        return None
    record = obs.allocation if obs.allocation is not None and obs.allocation.for_job(job.ids) else None
    events = obs.summary.fenced(job.ids, job.restart_count)
    restarted = obs.summary.restarted_in_allocation(job.ids, job.restart_count)
    if record is None and not events and restarted is None:
        return None
    evidence = {node: _evidence(event) for node, event in events.items()}
    if record is not None:
        for fence in record.fenced:
            evidence.setdefault(fence.node, "; ".join([fence.cause, *fence.evidence][:4]).strip("; "))
    fenced = frozenset(evidence)
    return AllocView(
        fenced=fenced,
        spares=frozenset(record.spares) - fenced if record is not None else frozenset(),
        active=frozenset(record.active) - fenced if record is not None else frozenset(),
        restarted_at=restarted, evidence=evidence)


def _evidence(event: journal.Event) -> str:
    said = event.get("evidence")
    if isinstance(said, list):
        said = "; ".join(str(s) for s in said[:4])
    text = str(said or event.get("cause") or "fenced by the launcher")
    return "".join(c if c.isprintable() else "?" for c in text[:300])


def batch_host(obs: RunObservation) -> str | None:
    """The node the job's batch script (and so its launcher and rendezvous store) runs on."""
    job = obs.job
    return job.batch_host if job is not None and job.batch_host else None
