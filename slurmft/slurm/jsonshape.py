"""Reading Slurm's ``--json`` documents field by field, across data_parser versions.

Slurm changes how a value is spelled from one data_parser to the next (a number is a plain int in
v0.0.38 and ``{"set", "infinite", "number"}`` later; a state is a string, then a list of flags;
an exit code is a raw wait status, then ``{"status", "return_code", "signal"}``). The helpers here
accept every spelling seen in real output and raise :class:`UnsupportedShape` naming the command
and the field path (``squeue --json: jobs[0].job_state: expected str or list, got dict``) for
anything else, so a future data_parser fails loudly instead of being read as "no value".
Pure functions: no subprocess, no I/O.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Mapping

from slurmft.slurm.client import JobNotFound, SlurmError, UnsupportedShape

# Slurm's NO_VAL/INFINITE sentinels for 32-bit times and counters ("never started" = NO_VAL - 1).
_INVALID_JOB_ID = 2017  # ESLURM_INVALID_JOB_ID
# ESLURM_REST_EMPTY_RESULT: 22.05's sacct --json for a job accounting has no record of says
# "Nothing found" as an error (23.02+ say it as a warning, with "jobs": []): no record, not a failure.
_NOTHING_FOUND = 9003
_SENTINELS = {0xFFFFFFFE, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFE, 0xFFFFFFFFFFFFFFFF}


class Where:
    """A field path inside one command's document, for error messages."""

    def __init__(self, command: str, path: str = "") -> None:
        self.command = command
        self.path = path

    def key(self, name: str) -> "Where":
        return Where(self.command, f"{self.path}.{name}" if self.path else name)

    def index(self, i: int) -> "Where":
        return Where(self.command, f"{self.path}[{i}]")

    def fail(self, expected: str, value: Any) -> UnsupportedShape:
        return UnsupportedShape(
            f"{self.command}: {self.path or '<document>'}: expected {expected}, got {type(value).__name__}"
        )

    def unknown(self, what: str, value: Any) -> UnsupportedShape:
        return UnsupportedShape(f"{self.command}: {self.path or '<document>'}: unknown {what} {value!r}")


def load_document(text: str, command: str, list_key: str, *, empty_ok: bool = False) -> dict[str, Any]:
    """Parse one ``--json`` document and check that ``list_key`` holds a list.

    Empty output is an error (a bad data_parser pin makes sacct print nothing with rc 0).
    ``empty_ok`` (accounting): errors that only say "Nothing found" are an empty ``list_key``.
    """
    if not text.strip():
        raise UnsupportedShape(f"{command}: printed no JSON")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnsupportedShape(f"{command}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except (ValueError, RecursionError) as exc:  # a number of 4,300+ digits; nesting too deep
        raise UnsupportedShape(f"{command}: unreadable JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
    where = Where(command)
    if not isinstance(doc, dict):
        raise where.fail("object", doc)
    if empty_ok and nothing_found(doc):
        return {**doc, "errors": [], list_key: []}
    raise_errors(doc, command)
    if not isinstance(doc.get(list_key), list):
        raise where.key(list_key).fail("list", doc.get(list_key))
    return doc


def nothing_found(doc: Mapping[str, Any]) -> bool:
    """Every error of ``doc`` is Slurm's "Nothing found" (and there is at least one)."""
    errors = doc.get("errors")
    return isinstance(errors, list) and bool(errors) and all(
        isinstance(e, dict) and e.get("error_number") == _NOTHING_FOUND for e in errors)


def raise_errors(doc: Mapping[str, Any], command: str) -> None:
    """A non-empty ``errors`` list is Slurm refusing the query: raise it, never read "no jobs".

    Error 2017 ("Invalid job id specified") becomes JobNotFound; anything else SlurmError.
    """
    errors = doc.get("errors") or []
    if not isinstance(errors, list) or not errors:
        return
    first = errors[0] if isinstance(errors[0], dict) else {"error": str(errors[0])}
    message = "; ".join(str(first.get(k)) for k in ("error", "description") if first.get(k))
    if first.get("error_number") == _INVALID_JOB_ID:
        raise JobNotFound(f"{command}: {message}")
    raise SlurmError(f"{command}: {message or errors!r}")


def records(doc: Mapping[str, Any], list_key: str, command: str) -> list[tuple[Where, Mapping[str, Any]]]:
    """The objects of ``doc[list_key]``, each paired with its path."""
    out: list[tuple[Where, Mapping[str, Any]]] = []
    base = Where(command).key(list_key)
    for i, item in enumerate(doc[list_key]):
        where = base.index(i)
        if not isinstance(item, dict):
            raise where.fail("object", item)
        out.append((where, item))
    return out


def meta_release(doc: Mapping[str, Any]) -> tuple[tuple[int, int, int] | None, str | None]:
    """(release, data_parser) from the ``meta`` block: ``meta.Slurm`` (<= 23.02) or ``meta.slurm``."""
    meta = doc.get("meta") or {}
    slurm = meta.get("slurm") or meta.get("Slurm") or {}
    version = slurm.get("version") or {}
    release = None
    try:
        release = (int(version["major"]), int(version["minor"]), int(version["micro"]))
    except (KeyError, TypeError, ValueError):
        pass
    plugin = meta.get("plugin") or meta.get("plugins") or {}
    parser = plugin.get("data_parser") if isinstance(plugin, dict) else None
    if isinstance(parser, str):
        parser = parser.rsplit("/", 1)[-1]
    return release, parser or None


def text(obj: Mapping[str, Any], key: str, where: Where, default: str = "") -> str:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise where.key(key).fail("str", value)
    return value


def number(obj: Mapping[str, Any], key: str, where: Where) -> int | None:
    """An int or a ``{set, infinite, number}`` object; None when absent, unset or infinite."""
    return number_value(obj.get(key), where.key(key))


def number_value(value: Any, where: Where) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise where.fail("int or {set, infinite, number}", value)
    if isinstance(value, int):
        return value
    if isinstance(value, dict) and "number" in value:
        if not value.get("set", True) or value.get("infinite", False):
            return None
        inner = value["number"]
        if isinstance(inner, bool) or not isinstance(inner, (int, float)):
            raise where.key("number").fail("number", inner)
        return int(inner)
    raise where.fail("int or {set, infinite, number}", value)


def timestamp(obj: Mapping[str, Any], key: str, where: Where) -> datetime | None:
    """A Unix time in either spelling; 0, NO_VAL and "infinite" mean no value (None)."""
    return timestamp_value(obj.get(key), where.key(key))


def timestamp_value(value: Any, where: Where) -> datetime | None:
    seconds = number_value(value, where)
    if seconds is None or seconds <= 0 or seconds in _SENTINELS:
        return None
    try:
        return datetime.fromtimestamp(seconds, tz=timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None  # far-future "end_time" of a job with no time limit


def state_names(value: Any, where: Where) -> list[str]:
    """A state as a list of upper-case names: ``"RUNNING"`` (<= v0.0.39) or ``["RUNNING", ...]``."""
    if isinstance(value, str):
        return [value.upper()] if value else []
    if isinstance(value, list):
        names = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise where.index(i).fail("str", item)
            names.append(item.upper())
        return names
    raise where.fail("str or list", value)
