"""Checks on every value that reaches a Slurm command line, run BEFORE any command runs.

Job ids, node names and signals must match Slurm's own forms; a drain reason is cleaned of
control characters and cut to one readable line. Anything else
raises :class:`InvalidArgument` naming the value, and nothing is run.
"""

from __future__ import annotations

import re
import signal as _signal
from typing import Iterable, Sequence

import hostlist

from slurmft.slurm.client import InvalidArgument

_JOB_ID_RE = re.compile(r"^[1-9][0-9]{0,9}(_[0-9]{1,10})?$")
# Slurm node names: letters, digits, '-', '_', '.'; no hostlist brackets, no spaces.
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# POSIX portable user names (plus upper case, as sites have them).
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]+")
# Slurm 22.05 stored a 5000-character (and a UTF-8) reason unchanged (measured): the limit is
# ours, to keep a reason one readable sinfo/scontrol line.
MAX_REASON = 200
_ELLIPSIS = "..."


def job_id(value: object) -> str:
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is None or not _JOB_ID_RE.fullmatch(text):
        raise InvalidArgument(f"invalid job id {value!r}: expected digits, optionally _<array task>")
    return text


_STEP_ID_RE = re.compile(r"^[0-9]{1,10}$")


def step_id(value: object) -> str:
    """A job step's number (``3`` of ``104.3``)."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is None or not _STEP_ID_RE.fullmatch(text):
        raise InvalidArgument(f"invalid step id {value!r}: expected digits")
    return text


def job_ids(values: Iterable[object]) -> list[str]:
    return [job_id(v) for v in values]


def user_name(value: object) -> str:
    if not isinstance(value, str) or not _USER_RE.fullmatch(value):
        raise InvalidArgument(f"invalid user name {value!r}: expected letters, digits, '.', '_', '-'")
    return value


def node_name(value: object) -> str:
    if not isinstance(value, str) or not _NODE_RE.fullmatch(value):
        raise InvalidArgument(f"invalid node name {value!r}: expected one name of letters, digits, '.', '_', '-'")
    return value


def node_names(values: Iterable[object]) -> list[str]:
    if isinstance(values, str):
        raise InvalidArgument(f"expected a list of node names, got the string {values!r}")
    return [node_name(v) for v in values]


def compress_nodes(names: Sequence[str]) -> str:
    """Sorted, de-duplicated hostlist expression (``n[1-3,7]``) of validated names."""
    return hostlist.collect_hostlist(sorted(set(node_names(names))))


def reason(value: object) -> str:
    """One line of printable text, at most MAX_REASON characters (cut with '...')."""
    if not isinstance(value, str):
        raise InvalidArgument(f"invalid reason {value!r}: expected text")
    clean = " ".join(_CONTROL_RE.sub(" ", value).split())
    if not clean:
        raise InvalidArgument("invalid reason: empty (Slurm requires a reason to drain a node)")
    if len(clean) > MAX_REASON:
        clean = clean[: MAX_REASON - len(_ELLIPSIS)].rstrip() + _ELLIPSIS
    return clean


def signal_name(value: object) -> str:
    """``USR2``, ``SIGUSR2`` or a number -> the name scancel takes (``USR2``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return _signal.Signals(value).name.removeprefix("SIG")
        except ValueError:
            pass
    elif isinstance(value, str):
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in _signal.Signals.__members__:
            return name.removeprefix("SIG")
    raise InvalidArgument(f"invalid signal {value!r}: expected a name like USR2 or a signal number")
