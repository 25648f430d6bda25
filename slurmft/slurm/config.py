"""``[slurm]`` settings of the Slurm client: timeouts, retries, data_parser pin, backend choice.

Loaded with ``slurmft.config.load_section(SlurmConfig, "slurm")`` (defaults < slurmft.toml <
``SLURMFT_SLURM_<FIELD>`` < flags); the checks below are the only place these values are judged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_PARSER_RE = re.compile(r"^v0\.0\.[0-9]{2}$")


@dataclass(frozen=True)
class SlurmConfig:
    # Seconds one squeue/scontrol/sacct/sbatch call may take before it counts as a transient failure.
    timeout: float = 20.0
    # Extra attempts after a transient failure (controller unreachable, socket timeout, our timeout).
    retries: int = 3
    # First backoff in seconds; doubles per attempt, capped at max_backoff.
    backoff: float = 1.0
    max_backoff: float = 15.0
    # Pin a --json data_parser (e.g. "v0.0.42"); empty = newest the running Slurm lists.
    data_parser: str = ""
    # "auto": pyslurm when it imports and matches the running Slurm, else the CLI.
    backend: Literal["auto", "cli", "pyslurm"] = "auto"

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff < 0 or self.max_backoff < self.backoff:
            raise ValueError(f"need 0 <= backoff <= max_backoff, got {self.backoff} and {self.max_backoff}")
        if self.data_parser and not _PARSER_RE.fullmatch(self.data_parser):
            raise ValueError(f"data_parser must look like v0.0.42, got {self.data_parser!r}")
