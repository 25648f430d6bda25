"""The sweep state's record, checked whole, field by field, before anything reads it.

Every key the sweeper keeps between runs is named here, with the shape its value must have. A
record with any value out of shape (a string where a number goes, a float, NaN, a negative
count, an unknown key) is not half-trusted: ``HealthState.load`` calls the whole file
unreadable, and the sweep keeps every drain it cannot prove it may lift (``slurmft/sweep/run.py``).
"""

from __future__ import annotations

from typing import Any, Callable

XID = "xid"  # {"boot_id": str, "position": {...}, "remembered": [{"code", "pci", "what"}]}
DRAIN = "drain"  # the failed checks a drain stands for: {"reason", "checks", "at"} or None
GPUS_SEEN = "gpu_bus_ids"  # every GPU an earlier sweep saw on this node
NVLINK = "nvlink"  # bus id -> link -> counter -> value, from the previous sweep
IB_LINK_DOWNED = "ib_link_downed"  # "device/port" -> link_downed counter
LOST = "lost"  # the memory was lost: {"boot_id", "at", "why"} or None

_MAX_INT = 2**64  # kernel sequence numbers, inodes, offsets and hardware counters fit below


def _int(value: Any, low: int = 0) -> bool:
    return type(value) is int and low <= value < _MAX_INT  # not bool, not float


def _strs(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _dict_of(value: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(value, dict) and all(ok(v) for v in value.values())


def _record(value: Any, fields: dict[str, Callable[[Any], bool]]) -> bool:
    return isinstance(value, dict) and set(value) == set(fields) \
        and all(ok(value[k]) for k, ok in fields.items())


def _position(value: Any) -> bool:
    return _record(value, {"kmsg_seq": lambda v: _int(v, -1)}) or _record(value, {
        "inode": lambda v: v is None or _int(v), "offset": _int})


def _xid(value: Any) -> bool:
    entry = {"code": _int, "pci": lambda v: isinstance(v, str), "what": lambda v: isinstance(v, str)}
    return _record(value, {"boot_id": lambda v: isinstance(v, str), "position": _position,
                           "remembered": lambda v: isinstance(v, list)
                           and all(_record(e, entry) for e in v)})


def _str(value: Any) -> bool:
    return isinstance(value, str)


SHAPES: dict[str, Callable[[Any], bool]] = {
    XID: _xid,
    DRAIN: lambda v: v is None or _record(v, {"reason": _str, "checks": _strs, "at": _str}),
    GPUS_SEEN: _strs,
    NVLINK: lambda v: _dict_of(v, lambda link: _dict_of(link, lambda c: _dict_of(c, _int))),
    IB_LINK_DOWNED: lambda v: _dict_of(v, _int),
    LOST: lambda v: v is None or _record(v, {"boot_id": _str, "at": _str, "why": _str}),
}


def problem(data: Any) -> str:
    """Why ``data`` is not a sweep state this slurmft can trust ("" when every field checks)."""
    if not isinstance(data, dict):
        return f"its data is a {type(data).__name__}, not an object"
    unknown = sorted(str(k) for k in data if k not in SHAPES)
    if unknown:
        return f"unknown field(s) {', '.join(unknown)[:200]}"
    bad = [k for k, ok in SHAPES.items() if k in data and not ok(data[k])]
    return f"field(s) {', '.join(bad)} out of shape" if bad else ""
