"""``[slurm]`` settings of the Slurm client: timeouts, retries, data_parser pin, backend choice.

Loaded with ``slurmft.config.load_section(SlurmConfig, "slurm")`` (defaults < slurmft.toml <
``SLURMFT_SLURM_<FIELD>`` < flags); the checks below are the only place these values are judged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from slurmft.numbers import integer, number

_PARSER_RE = re.compile(r"^v0\.0\.[0-9]{2}$")
MAX_CALL_S = 3600.0  # one Slurm call's timeout and a backoff between retries: an hour at most
MAX_RETRIES = 100


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
        # Finite and bounded (``SLURMFT_SLURM_TIMEOUT=inf``, ``nan`` or ``1e300`` once gave a
        # traceback in every command): a call's timeout becomes a wait Python must accept.
        number(self.timeout, "timeout", lo=0.0, hi=MAX_CALL_S, above=True)
        integer(self.retries, "retries", lo=0, hi=MAX_RETRIES)
        number(self.backoff, "backoff", lo=0.0, hi=MAX_CALL_S)
        number(self.max_backoff, "max_backoff", lo=0.0, hi=MAX_CALL_S)
        if self.max_backoff < self.backoff:
            raise ValueError(f"need 0 <= backoff <= max_backoff, got {self.backoff} and {self.max_backoff}")
        if self.data_parser and not _PARSER_RE.fullmatch(self.data_parser):
            raise ValueError(f"data_parser must look like v0.0.42, got {self.data_parser!r}")
