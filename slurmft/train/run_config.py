"""``[loop]`` settings of :class:`slurmft.train.Run` (slurmft.toml, ``SLURMFT_LOOP_<FIELD>``, arguments).

Torch-free. The other in-job sections ``Run`` reads are ``[checkpoint]``
(:class:`slurmft.checkpoint.config.CheckpointConfig`) and ``[guards]``
(:class:`slurmft.train.guards.GuardConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from slurmft.config import load_section

SECTION = "loop"


@dataclass(frozen=True)
class RunConfig:
    """``[loop]``: how often ``Run`` beats, journals and watches; its seed for ``Run.rng``.

    heartbeat_interval_s: seconds between heartbeat writes by each node's local rank 0, at step
        boundaries: every step when steps are longer, and always at a segment's first step (10).
    log_every: steps between ``loss`` events in the journal, rank 0 (10; 0 = none). They are
        buffered and written with the next durable event (``[journal]``), not fsynced each.
    watchdog: run the step-time watchdog (True).
    watchdog_timeout_s: a step's time limit in seconds; None = adaptive, 10 x the median step
        after 5 steps, at least 60 s (None).
    seed: the seed ``Run.rng(step)`` mixes with the step and rank (0).
    check_boundaries: warn when random state moves outside a step (True).
    time_forward: time this node's model forward pass for the heartbeat's ``busy_s``, which the
        watcher's straggler rule compares across nodes (True; ``slurmft.train.busy``).
    """

    heartbeat_interval_s: float = 10.0
    log_every: int = 10
    watchdog: bool = True
    watchdog_timeout_s: float | None = None
    seed: int = 0
    check_boundaries: bool = True
    time_forward: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.heartbeat_interval_s <= 3600:
            raise ValueError(f"heartbeat_interval_s must be between 0 and 3600 seconds, got "
                             f"{self.heartbeat_interval_s}")
        if self.log_every < 0:
            raise ValueError(f"log_every must be >= 0, got {self.log_every}")
        if self.watchdog_timeout_s is not None and self.watchdog_timeout_s <= 0:
            raise ValueError(f"watchdog_timeout_s must be > 0, got {self.watchdog_timeout_s}")

    @classmethod
    def load(cls, config_file: str | Path | None = None, *, environ: Mapping[str, str] | None = None,
             **overrides: Any) -> "RunConfig":
        """Defaults < ``[loop]`` of the config file < environment < ``overrides`` (None = not given)."""
        return load_section(cls, SECTION, config_file=config_file, environ=environ, overrides=overrides)
