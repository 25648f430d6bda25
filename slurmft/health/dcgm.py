"""DCGM, when ``dcgmi`` is installed: ``dcgmi health -c -j`` each sweep (``--quick`` included: it
only reads the host engine's watches), ``dcgmi diag -r 1`` in deep mode only (it takes tens of
seconds and must not run while a job uses the GPUs). The watches themselves are the site's to set
(``dcgmi health -s a`` once per boot, e.g. from nv-hostengine's unit).

DCGM health alone is not a drain signal to trust blindly: it can say "Healthy" while a GPU needs
a reset after Xid 120 (NVIDIA/DCGM#263, fixture ``healthy_json_but-gpu1-needs-reset``), so the
Xid and recovery-action checks run beside it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from typing import Any

from slurmft.health import proc
from slurmft.health.facts import Facts, Unavailable
from slurmft.health.result import CheckResult, findings
from slurmft.health.state import HealthState

HEALTH_FACT = "dcgm_health"
DIAG_FACT = "dcgm_diag"


@dataclass(frozen=True)
class DcgmConfig:
    """``[health_dcgm]``: the dcgmi command lines and their timeouts."""

    health_argv: tuple[str, ...] = ("dcgmi", "health", "-c", "-j")
    diag_argv: tuple[str, ...] = ("dcgmi", "diag", "-r", "1")
    timeout_s: float = 10.0
    diag_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        proc.validate_argv(self.health_argv, "health_argv")
        proc.validate_argv(self.diag_argv, "diag_argv")
        if self.timeout_s <= 0 or self.diag_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")


def run_dcgmi(argv: tuple[str, ...], timeout_s: float) -> proc.ProcResult | Unavailable:
    if shutil.which(argv[0]) is None:
        return Unavailable(f"{argv[0]} not installed")
    return proc.run(argv, timeout_s)


def parse_health_json(text: str) -> tuple[str, list[str]]:
    """(overall value, incident texts) from ``dcgmi health -c -j``; ValueError on other shapes."""
    doc = json.loads(text)
    body = doc.get("body") if isinstance(doc, dict) else None
    if not isinstance(body, dict) or "Overall Health" not in body:
        raise ValueError("dcgmi health JSON has no body.\"Overall Health\"")
    overall = body["Overall Health"]
    value = overall.get("value") if isinstance(overall, dict) else overall
    incidents: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path} {k}".strip())
        elif isinstance(node, list):
            for v in node:
                walk(v, path)
        elif isinstance(node, str) and node.strip():
            incidents.append(f"{path}: {node.strip()}" if path else node.strip())

    walk({k: v for k, v in body.items() if k != "Overall Health"}, "")
    return str(value), incidents


def parse_diag_table(text: str) -> list[tuple[str, str]]:
    """(test, result text) rows of a ``dcgmi diag`` table, wrapped cells joined back together.

    dcgmi wraps the result column at 46 characters, even mid-word, and continues a row on lines
    whose first cell is blank: those are glued to the previous row without adding spaces.
    """
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("|") or line.startswith("|-----") or line.startswith("+"):
            continue
        cells = line.strip().strip("|").split("|", 1)
        if len(cells) != 2:
            continue
        name, value = cells[0].strip(), cells[1].rstrip()
        value = value[1:] if value.startswith(" ") else value
        if name and name != "Diagnostic":
            rows.append([name, value])
        elif not name and rows:
            rows[-1][1] = rows[-1][1] + value if len(rows[-1][1]) >= 45 else f"{rows[-1][1]} / {value.strip()}"
    return [(n, " ".join(v.split())) for n, v in rows]


def check_dcgm_health(facts: Facts, cfg: DcgmConfig, state: HealthState) -> CheckResult:
    name = "dcgm_health"
    res: proc.ProcResult = facts.need(HEALTH_FACT)
    if res.timed_out:
        return CheckResult.fail(name, f"{' '.join(res.argv)} timed out after {cfg.timeout_s:g} s")
    try:
        overall, incidents = parse_health_json(res.output)
    except ValueError as exc:
        first = res.output.strip().splitlines()[0] if res.output.strip() else f"exit {res.returncode}"
        return CheckResult.fail(name, f"dcgmi health unreadable ({exc}): {first}")
    detail = "; ".join(incidents) or f"overall {overall}"
    if overall == "Healthy":
        return CheckResult.ok(name, "DCGM overall Healthy")
    if overall == "Warning":
        return CheckResult.warn(name, detail)
    return CheckResult.fail(name, detail)


def check_dcgm_diag(facts: Facts, cfg: DcgmConfig, state: HealthState) -> CheckResult:
    name = "dcgm_diag"
    res: proc.ProcResult = facts.need(DIAG_FACT)
    if res.timed_out:
        return CheckResult.fail(name, f"{' '.join(res.argv)} timed out after {cfg.diag_timeout_s:g} s")
    rows = parse_diag_table(res.output)
    if not rows:
        first = res.output.strip().splitlines()[0] if res.output.strip() else f"exit {res.returncode}"
        return CheckResult.fail(name, f"dcgmi diag gave no result table: {first}")
    fail = [f"{t}: {v}" for t, v in rows if t == "Error" or "Fail" in v.split(" - ")[0] or " / Fail" in v]
    warn = [f"{t}: {v}" for t, v in rows if t == "Warning"]
    return findings(name, fail, warn, f"dcgmi diag: {len(rows)} rows, all pass")
