"""``[sweep]``: which checks, the blast-radius share, where state, reports and metrics go."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Every drain slurmft makes starts with this; only such drains are ever resumed by slurmft.
REASON_PREFIX = "slurmft:"


@dataclass(frozen=True)
class SweepConfig:
    checks: tuple[str, ...] = ()  # empty: every built-in and external check
    # Blast-radius guard: do not drain another node once this share of all nodes is drained by
    # slurmft. It rounds down, but at least ``min_drain_allowed`` nodes may always be drained
    # (10 % of 4 nodes = 0.4 -> 1 node).
    max_drain_share: float = 0.10
    min_drain_allowed: int = 1
    state_dir: Path = Path("/var/lib/slurmft")
    report_dir: Path = Path("/var/lib/slurmft/reports")
    textfile_dir: Path | None = Path("/var/lib/prometheus/node-exporter")
    fact_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_drain_share <= 1.0:
            raise ValueError(f"max_drain_share must be between 0 and 1, got {self.max_drain_share}")
        if self.min_drain_allowed < 0:
            raise ValueError("min_drain_allowed must be >= 0")
        if not 0 < self.fact_timeout_s <= 50:
            # HealthCheckProgram gets 60 s from Slurm; leave room for the Slurm calls.
            raise ValueError("fact_timeout_s must be > 0 and <= 50")
