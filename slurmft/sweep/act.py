"""Carry out a sweep decision through ``SlurmClient`` (the only place the sweeper changes Slurm).

``Outcome.acted`` says what happened to the node whatever failed afterwards: a drain that
landed is reported as drained even when the blast-radius re-read or a withdrawal then fails.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurmft.slurm.client import OutcomeUnknown, SlurmClient, SlurmError
from slurmft.sweep.config import SweepConfig
from slurmft.sweep.decide import Action, Decision, drain_allowance, drained_by_slurmft, keep_after_race

DRAINED, RESUMED, WITHDRAWN = "drained", "resumed", "drain withdrawn (race)"
UNKNOWN = "{} may have happened (no answer, and the node could not be read back)"


@dataclass(frozen=True)
class Outcome:
    acted: str  # DRAINED, RESUMED, WITHDRAWN, UNKNOWN, or "" (nothing done)
    error: str = ""  # a Slurm call failed (exit 4); what did happen is still in ``acted``
    detail: str = ""  # why a drain was withdrawn


def _err(exc: SlurmError) -> str:
    return f"{type(exc).__name__}: {exc}"


def apply(decision: Decision, node: str, client: SlurmClient, cfg: SweepConfig) -> Outcome:
    if decision.action is Action.DRAIN:
        try:
            client.drain(node, decision.reason)
        except OutcomeUnknown as exc:
            return Outcome(UNKNOWN.format("drain"), _err(exc))
        except SlurmError as exc:
            return Outcome("", f"drain failed: {_err(exc)}")
        return _guard_after_drain(node, client, cfg)
    if decision.action is Action.RESUME:
        try:
            client.resume(node)
        except OutcomeUnknown as exc:
            return Outcome(UNKNOWN.format("resume"), _err(exc))
        except SlurmError as exc:
            return Outcome("", f"resume failed: {_err(exc)}")
        return Outcome(RESUMED)
    return Outcome("")


def _guard_after_drain(node: str, client: SlurmClient, cfg: SweepConfig) -> Outcome:
    """Re-read the nodes now that this drain has landed; withdraw it if racing sweeps have
    taken slurmft past its allowance (``keep_after_race``)."""
    try:
        after = client.nodes()
    except SlurmError as exc:
        # The node failed its checks and the guard passed before the drain: keep it.
        return Outcome(DRAINED, "drained, but could not re-read the nodes to check the "
                                f"blast-radius guard against racing sweeps: {_err(exc)}")
    if keep_after_race(after, cfg):
        return Outcome(DRAINED)
    ours, allowed = drained_by_slurmft(after), drain_allowance(len(after), cfg)
    why = (f"blast-radius guard: {len(ours)} nodes drained by slurmft after racing sweeps "
           f"({', '.join(ours)}), at most {allowed} allowed")
    try:
        client.resume(node)
    except SlurmError as exc:
        return Outcome(DRAINED, f"{why}; withdrawing this drain failed: {_err(exc)}")
    return Outcome(WITHDRAWN, detail=f"{why}; withdrew this drain")
