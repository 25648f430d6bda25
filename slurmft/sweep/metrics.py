"""Prometheus textfile for node_exporter's textfile collector, written with prometheus_client
(``CollectorRegistry`` + ``write_to_textfile``, which writes a temp file and renames it).

Metrics (all labelled ``node``); the alert rules in ``deploy/prometheus/slurmft-alerts.yml`` use them:
  slurmft_health_check_status{check,status}   1 for the check's current status, 0 for the others
  slurmft_sweep_node_healthy                  1 when no check failed
  slurmft_sweep_action{action}                1 for what this sweep decided (none/drain/resume/blocked/keep)
  slurmft_sweep_blast_radius_blocked          1 when the guard refused or withdrew a drain (critical alert)
  slurmft_sweep_nodes_drained_by_slurmft      nodes slurmft has drained, as this sweep saw them
  slurmft_sweep_drain_allowance               how many nodes slurmft may drain
  slurmft_sweep_slurm_error                   1 when Slurm could not be read or the action failed
  slurmft_sweep_write_error                   1 when writing the state or the report failed (this file
                                              is written last, so it carries the earlier failures)
  slurmft_sweep_duration_seconds, slurmft_sweep_last_run_timestamp_seconds
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from slurmft.health.result import Status
from slurmft.sweep.act import WITHDRAWN
from slurmft.sweep.decide import Action
from slurmft.sweep.report import SweepReport

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# prometheus_client is imported where a textfile is built, not at import: the launcher's
# pre-flight (the quick dry-run sweep with ``--json`` on every node of every job start)
# writes none, and the import was a quarter of that command's CPU.


def textfile_path(textfile_dir: Path, node: str) -> Path:
    return Path(textfile_dir) / f"slurmft_sweep_{node}.prom"


def build_registry(report: SweepReport) -> CollectorRegistry:
    from prometheus_client import CollectorRegistry, Gauge

    reg = CollectorRegistry()
    node = report.node
    status = Gauge("slurmft_health_check_status", "Current status of one health check (one-hot)",
                   ["node", "check", "status"], registry=reg)
    for r in report.results:
        for s in Status:
            status.labels(node, r.check, s.value).set(1 if r.status is s else 0)

    def gauge(name: str, doc: str, value: float) -> None:
        Gauge(name, doc, ["node"], registry=reg).labels(node).set(value)

    gauge("slurmft_sweep_node_healthy", "1 when no health check failed", 1 if report.healthy else 0)
    action = Gauge("slurmft_sweep_action", "What the last sweep decided (one-hot)", ["node", "action"],
                   registry=reg)
    decided = report.decision.action if report.decision else None
    for a in Action:
        action.labels(node, a.value).set(1 if decided is a else 0)
    gauge("slurmft_sweep_blast_radius_blocked", "1 when the blast-radius guard refused a drain",
          1 if decided is Action.BLOCKED or report.outcome.acted == WITHDRAWN else 0)
    if report.decision:
        gauge("slurmft_sweep_nodes_drained_by_slurmft", "Nodes drained by slurmft, as seen by this sweep",
              report.decision.drained_by_slurmft)
        gauge("slurmft_sweep_drain_allowance", "How many nodes slurmft may drain", report.decision.allowed)
    gauge("slurmft_sweep_slurm_error", "1 when Slurm could not be read or the action failed",
          1 if (report.slurm_error or report.outcome.error) else 0)
    gauge("slurmft_sweep_write_error", "1 when writing the sweep's state, report or textfile failed",
          1 if report.write_errors else 0)
    gauge("slurmft_sweep_duration_seconds", "Wall time of the last sweep", report.duration_s)
    gauge("slurmft_sweep_last_run_timestamp_seconds", "When the last sweep started (Unix time)",
          report.started.timestamp())
    return reg


def write_textfile(report: SweepReport, textfile_dir: Path) -> Path:
    from prometheus_client import write_to_textfile

    path = textfile_path(textfile_dir, report.node)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(path), build_registry(report))
    return path
