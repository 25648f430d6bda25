"""Carry out a sweep decision through ``SlurmClient`` (the only place the sweeper changes Slurm)."""

from __future__ import annotations

from dataclasses import dataclass

from slurmft.slurm.client import SlurmClient, SlurmError
from slurmft.sweep.config import SweepConfig
from slurmft.sweep.decide import Action, Decision, keep_after_race


@dataclass(frozen=True)
class Outcome:
    acted: str  # "drained", "resumed", "drain withdrawn (race)", "" (nothing done)
    error: str = ""


def apply(decision: Decision, node: str, client: SlurmClient, cfg: SweepConfig) -> Outcome:
    try:
        if decision.action is Action.DRAIN:
            client.drain(node, decision.reason)
            after = client.nodes()
            if not keep_after_race(node, after, cfg):
                client.resume(node)
                return Outcome("drain withdrawn (race)",
                               "blast-radius guard: other sweeps drained at the same time; withdrew this drain")
            return Outcome("drained")
        if decision.action is Action.RESUME:
            client.resume(node)
            return Outcome("resumed")
    except SlurmError as exc:
        return Outcome("", f"{type(exc).__name__}: {exc}")
    return Outcome("")
