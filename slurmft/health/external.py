"""External checks: any command from the config (argv list, timeout). Exit 0 passes; any other
exit fails with the first line of its output as the detail (and so as the drain reason). This is
how a site plugs in its NHC scripts, and how tests make a node fail.

A check's output is bounded (:data:`slurmft.health.proc.MAX_OUTPUT_BYTES`: one that prints more
is killed and fails), its children are killed with it (its process group), and its own
``timeout_s`` holds even when a child keeps the output pipe open. The detail is one line of at
most ``MAX_DETAIL_CHARS`` characters.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from slurmft.health import proc
from slurmft.health.facts import Facts
from slurmft.health.result import CheckResult

PREFIX = "external_"
MAX_DETAIL_CHARS = 200
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,40}$")


@dataclass(frozen=True)
class ExternalCheck:
    """One ``[[health_external.commands]]`` entry; its check is named ``external_<name>``."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float = 10.0
    quick: bool = False  # part of --quick (the sbatch pre-flight): only if it is fast

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r} must match {_NAME.pattern}")
        proc.validate_argv(self.argv, "argv")
        exe = self.argv[0]
        if ("/" in exe and not Path(exe).is_file()) or ("/" not in exe and shutil.which(exe) is None):
            raise ValueError(f"argv[0] {exe!r} does not exist")
        if "/" in exe and not os.access(exe, os.X_OK):
            raise ValueError(f"argv[0] {exe!r} is not executable")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")

    @property
    def check_name(self) -> str:
        return PREFIX + self.name


@dataclass(frozen=True)
class ExternalConfig:
    """``[health_external]``: the site's commands."""

    commands: tuple[ExternalCheck, ...] = ()

    def __post_init__(self) -> None:
        names = [c.name for c in self.commands]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"commands: duplicate name {dup[0]!r}")


def run_external(check: ExternalCheck) -> proc.ProcResult:
    return proc.run(check.argv, check.timeout_s)


def check_external(check: ExternalCheck, facts: Facts) -> CheckResult:
    res: proc.ProcResult = facts.need(check.check_name)
    first = next((ln.strip() for ln in res.output.splitlines() if ln.strip()), "")
    if len(first) > MAX_DETAIL_CHARS:
        first = first[:MAX_DETAIL_CHARS] + "..."
    if res.overflowed:
        return CheckResult.fail(check.check_name, f"printed more than {proc.MAX_OUTPUT_BYTES} bytes; killed")
    if res.timed_out:
        return CheckResult.fail(check.check_name, f"timed out after {check.timeout_s:g} s")
    if res.returncode != 0:
        return CheckResult.fail(check.check_name, first or f"exit {res.returncode}")
    return CheckResult.ok(check.check_name, first or "exit 0")
