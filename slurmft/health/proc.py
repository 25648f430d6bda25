"""Run one external program for a health source: argv list, validated, always with a timeout.

Health sources (dcgmi, site scripts) are not Slurm commands; they are run here and nowhere else
in ``slurmft.health``. A program that overruns its timeout is killed with its process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ProcResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: killed after the timeout
    output: str  # stdout then stderr, decoded leniently

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def validate_argv(argv: Sequence[str], where: str) -> tuple[str, ...]:
    """A non-empty list of non-empty strings without NUL bytes, else ValueError naming ``where``."""
    if isinstance(argv, str) or not isinstance(argv, (list, tuple)) or not argv:
        raise ValueError(f"{where} must be a non-empty list of strings")
    for i, arg in enumerate(argv):
        if not isinstance(arg, str) or not arg or "\0" in arg:
            raise ValueError(f"{where}[{i}] must be a non-empty string without NUL bytes")
    return tuple(argv)


def run(argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None) -> ProcResult:
    """Run ``argv`` (no shell) with stdin closed; kill its process group after ``timeout_s``."""
    args = validate_argv(argv, "argv")
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, env=env,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return ProcResult(args, None, (out + err).decode(errors="replace"))
    return ProcResult(args, proc.returncode, (out + err).decode(errors="replace"))
