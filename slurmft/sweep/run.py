"""One sweep, in order: lock, read Slurm's view of the nodes, gather facts and run the checks,
decide, act (unless dry-run), save state, write the report and the metrics textfile.

A Slurm controller that cannot be read does not stop the checks: they still run and are
reported, and nothing is acted on ("could not observe" is never "healthy").

Before draining, the failed checks are saved in the state file (which checks a drain stands
for: ``decide`` lifts it only once each of them ran and passed); the drain reason in Slurm is
the durable record of the drain itself.

The state is the sweep's memory of fatal events (Xids remembered for the boot, GPUs seen, the
checks behind a drain). When it cannot be read or does not check, that memory is lost, and a
check that "ran and passed" proves nothing about what it forgot: the new state records the loss
(``lost``, for this boot), and until the node reboots or an admin runs ``--forget-xids`` every
slurmft drain the new memory has no record of is kept, saying so. Once the sweep has acted, no write failure hides what
it did: each failed write is kept in ``SweepReport.write_errors`` and the report is returned.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from slurmft.config import ConfigError
from slurmft.health import xid
from slurmft.health.registry import HealthConfig, Mode, check_timeouts, plan, run_plan
from slurmft.health.result import CheckResult, Status
from slurmft.health.state import HealthState
from slurmft.health.state_check import DRAIN, LOST
from slurmft.slurm.client import Node, SlurmClient, SlurmError
from slurmft.slurm.validate import node_name
from slurmft.sweep.act import RESUMED, WITHDRAWN, Outcome, apply
from slurmft.sweep.config import SweepConfig
from slurmft.sweep.decide import Action, Decision, decide
from slurmft.sweep.lock import SweepLock
from slurmft.sweep.metrics import write_textfile
from slurmft.sweep.report import SweepReport, now, write_report


@dataclass(frozen=True)
class SweepRequest:
    node: str
    mode: Mode = "normal"
    dry_run: bool = False
    forget_xids: bool = False

    def __post_init__(self) -> None:
        node_name(self.node)  # it names state and report files: Slurm's node-name form only


def state_path(cfg: SweepConfig, node: str) -> Path:
    return Path(cfg.state_dir) / f"health-{node}.json"


def lock_path(cfg: SweepConfig, node: str) -> Path:
    return Path(cfg.state_dir) / f"sweep-{node}.lock"


def recorded_checks(state: HealthState, node: Node) -> tuple[str, ...]:
    """The checks saved as the cause of this node's drain, if the drain in Slurm is that one."""
    rec = state.get(DRAIN)
    if not isinstance(rec, dict) or rec.get("reason") != node.reason:
        return ()
    checks = rec.get("checks")
    if not isinstance(checks, list) or not all(isinstance(c, str) for c in checks):
        return ()
    return tuple(checks)


def memory_lost(state: HealthState, boot: str) -> str:
    """Why no drain made before now can be proven safe to lift ("" when the memory is whole).
    A loss lasts for the boot it happened in: remembered Xids end with it anyway."""
    rec = state.get(LOST)
    if not rec:
        return ""
    if rec["boot_id"] and boot and rec["boot_id"] != boot:
        state.set(LOST, None)
        return ""
    return (f"the sweep's memory of this node was lost at {rec['at']} ({rec['why']}), so a drain "
            f"made before then cannot be proven safe to lift; it stays until the node reboots, or "
            f"an admin checks the GPUs and runs slurmft sweep --forget-xids")


def _remember_loss(state: HealthState, boot: str, dry_run: bool) -> str:
    """Record in the new state that the old one was unreadable; the note for the report."""
    state.set(LOST, {"boot_id": boot, "at": now().isoformat(),
                     "why": f"state file unreadable: {state.unreadable}"})
    kept = "left in place (dry run)" if dry_run else f"kept as it was in {state.aside}"
    return (f"{state.note}: remembered Xids, the checks behind a drain and the GPUs seen are "
            f"lost; slurmft's drains made before now are kept; the file is {kept}")


def _attempt(what: str, write: Callable[[], object], errors: list[str]) -> None:
    try:
        write()
    except OSError as exc:
        errors.append(f"{what}: {exc.filename or ''}: {exc.strerror or exc}")


def _act(decision: Decision, req: SweepRequest, results: list[CheckResult], state: HealthState,
         client: SlurmClient, cfg: SweepConfig, errors: list[str]) -> Outcome:
    if decision.action is Action.DRAIN:
        failed = [r.check for r in results if r.status is Status.FAIL]
        state.set(DRAIN, {"reason": decision.reason, "checks": failed, "at": now().isoformat()})
        _attempt("state (before draining)", state.save, errors)  # a full disk still drains
    outcome = apply(decision, req.node, client, cfg)
    if outcome.acted in (RESUMED, WITHDRAWN):
        state.set(DRAIN, None)
    return outcome


def _persist(report: SweepReport, state: HealthState, cfg: SweepConfig,
             errors: list[str]) -> SweepReport:
    """State, report, textfile: each attempted; every failure is carried into what follows."""
    _attempt("state", state.save, errors)
    report = dataclasses.replace(report, write_errors=tuple(errors))
    _attempt("report", lambda: write_report(report, cfg.report_dir), errors)
    report = dataclasses.replace(report, write_errors=tuple(errors))
    textfile_dir = cfg.textfile_dir
    if textfile_dir is not None:
        _attempt("textfile", lambda: write_textfile(report, textfile_dir), errors)
    return dataclasses.replace(report, write_errors=tuple(errors))


def _nodes(client: SlurmClient) -> tuple[dict[str, Node] | None, str]:
    try:
        return client.nodes(), ""
    except SlurmError as exc:
        return None, f"could not read nodes from Slurm: {type(exc).__name__}: {exc}"


def sweep(req: SweepRequest, cfg: SweepConfig, hc: HealthConfig, client: SlurmClient,
          nvml: Any = None) -> SweepReport:
    """Run one sweep; raises LockHeld, or ConfigError (unknown check, unknown node) before acting."""
    the_plan = plan(cfg.checks, hc, req.mode)  # config errors surface before anything runs
    check_timeouts(the_plan, hc, cfg.fact_timeout_s)
    with SweepLock(lock_path(cfg, req.node)):
        started, t0 = now(), time.monotonic()
        nodes, slurm_error = _nodes(client)
        if nodes is not None and req.node not in nodes:
            raise ConfigError(f"--node {req.node!r}: Slurm knows no such node "
                              f"(nodes: {', '.join(sorted(nodes)) or 'none'})")
        state = HealthState.load(state_path(cfg, req.node))
        boot = xid.boot_id()
        notes = [_remember_loss(state, boot, req.dry_run)] if state.unreadable else []
        if req.forget_xids:
            xid.forget(state)
            state.set(LOST, None)
            notes.append("remembered drain-level Xids and any lost memory forgotten (--forget-xids)")
        lost = memory_lost(state, boot)
        results, facts = run_plan(the_plan, hc, state, cfg.fact_timeout_s, nvml)
        # Decide on the nodes as they are now, not as they were before the checks ran (up to
        # fact_timeout_s ago): a human may have drained this node in the meantime.
        nodes, slurm_error = _nodes(client) if nodes is not None else (None, slurm_error)
        if nodes is not None and req.node not in nodes:
            nodes, slurm_error = None, f"node {req.node} disappeared from Slurm during the sweep"
        decision = None if nodes is None else decide(
            nodes[req.node], results, nodes, cfg, recorded_checks(state, nodes[req.node]), lost)
        outcome = Outcome("")
        errors: list[str] = []
        if decision is not None and not req.dry_run:
            outcome = _act(decision, req, results, state, client, cfg, errors)
        report = SweepReport(req.node, req.mode, req.dry_run, started, time.monotonic() - t0,
                             tuple(results), decision, outcome, slurm_error, tuple(notes),
                             dict(facts.durations))
        if not req.dry_run:
            report = _persist(report, state, cfg, errors)
        return report
