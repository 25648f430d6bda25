"""The sweep report: one JSON document per node under ``[sweep] report_dir`` (atomic write), read
later by ``slurmft watch`` and by people. Versioned; times are UTC ISO-8601.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from slurmft.health.result import CheckResult, Status, worst
from slurmft.rundir import atomic_write_json
from slurmft.sweep.act import Outcome
from slurmft.sweep.decide import Decision

REPORT_VERSION = 1


@dataclass(frozen=True)
class SweepReport:
    node: str
    mode: str
    dry_run: bool
    started: datetime
    duration_s: float
    results: tuple[CheckResult, ...]
    decision: Decision | None  # None when Slurm could not be observed
    outcome: Outcome
    slurm_error: str = ""
    notes: tuple[str, ...] = ()
    fact_seconds: Mapping[str, float] = field(default_factory=dict)  # how long each source took
    write_errors: tuple[str, ...] = ()  # state/report/textfile writes that failed (after acting)

    @property
    def status(self) -> Status:
        return worst(self.results)

    @property
    def healthy(self) -> bool:
        return self.status is not Status.FAIL

    def to_json(self) -> dict[str, Any]:
        d = self.decision
        return {
            "version": REPORT_VERSION,
            "node": self.node,
            "mode": self.mode,
            "dry_run": self.dry_run,
            "started": self.started.astimezone(timezone.utc).isoformat(),
            "duration_s": round(self.duration_s, 4),
            "status": self.status.value,
            "results": [r.to_json() for r in self.results],
            "decision": None if d is None else {
                "action": d.action.value, "why": d.why, "reason": d.reason,
                "drained_by_slurmft": d.drained_by_slurmft, "allowed": d.allowed},
            "acted": self.outcome.acted,
            "acted_detail": self.outcome.detail,
            "error": self.outcome.error or self.slurm_error,
            "write_errors": list(self.write_errors),
            "notes": list(self.notes),
            "fact_seconds": {k: round(v, 4) for k, v in sorted(self.fact_seconds.items())},
        }


def report_path(report_dir: Path, node: str) -> Path:
    return Path(report_dir) / f"{node}.json"


def write_report(report: SweepReport, report_dir: Path) -> Path:
    path = report_path(report_dir, report.node)
    atomic_write_json(path, report.to_json())
    return path


def now() -> datetime:
    return datetime.now(timezone.utc)
