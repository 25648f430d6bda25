"""What one health check says: ``CheckResult(status, check, detail)``.

``detail`` is one line; when the status is ``fail`` it is also the drain reason, so it names the
device and the number that was wrong ("GPU 3 (0000:3b:00.0): 2 volatile double-bit ECC errors").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable


class Status(str, enum.Enum):
    """Outcome of one check. ``skipped`` means the check could not run here (no GPU, no dcgmi)."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIPPED = "skipped"


_SEVERITY = {Status.OK: 0, Status.SKIPPED: 0, Status.WARN: 1, Status.FAIL: 2}


def one_line(text: str, limit: int = 300) -> str:
    """Collapse whitespace and control characters; cut at ``limit`` characters on a word boundary."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 3].rsplit(" ", 1)[0]
    return cut + "..."


@dataclass(frozen=True)
class CheckResult:
    status: Status
    check: str
    detail: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))
        object.__setattr__(self, "detail", one_line(self.detail))

    @classmethod
    def ok(cls, check: str, detail: str) -> "CheckResult":
        return cls(Status.OK, check, detail)

    @classmethod
    def warn(cls, check: str, detail: str) -> "CheckResult":
        return cls(Status.WARN, check, detail)

    @classmethod
    def fail(cls, check: str, detail: str) -> "CheckResult":
        return cls(Status.FAIL, check, detail)

    @classmethod
    def skipped(cls, check: str, detail: str) -> "CheckResult":
        return cls(Status.SKIPPED, check, detail)

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "status": self.status.value, "detail": self.detail}


def worst(results: Iterable[CheckResult]) -> Status:
    """FAIL over WARN over OK; skipped counts as OK. An empty list is OK."""
    top = Status.OK
    for r in results:
        if _SEVERITY[r.status] > _SEVERITY[top]:
            top = r.status
    return top


def findings(check: str, problems: list[str], warnings: list[str], ok_detail: str) -> CheckResult:
    """Fold per-device problems into one result: any problem fails, else any warning warns."""
    if problems:
        return CheckResult.fail(check, "; ".join(problems))
    if warnings:
        return CheckResult.warn(check, "; ".join(warnings))
    return CheckResult.ok(check, ok_detail)
