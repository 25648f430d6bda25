"""Numbers from outside, read in one place: finite, in range for their use, or refused by name.

A number crosses a trust boundary wherever slurmft reads what someone else wrote: a run dir's
journal, records and manifests (the job's user), the watcher's saved state, ``slurmft.toml`` and
``SLURMFT_*`` settings, command-line values. JSON and TOML carry numbers Python cannot use as
they are (``NaN``, ``Infinity``, ``1e400`` read as infinity, an integer of 400 digits that
``float()`` refuses with ``OverflowError``), and a finite number may still be too large for its
use (``time.sleep(1e300)`` raises). So every such number is taken through one function here,
at the boundary, which returns a plain ``float`` or ``int`` that is finite and within the range
its use allows (or ``None`` / ``InvalidNumber`` naming the field); code inside works with those
plain types and never meets a non-finite value. The other way out: :func:`dumps` is how slurmft
prints JSON, and what it prints is always valid JSON (no ``NaN`` or ``Infinity``).

* ``finite``/``whole`` (and ``unix_time``/``seconds``/``count``): lenient, for fields of a record
  that a reader can do without (a journal event's duration): the value, or None.
* ``number``/``integer``: strict, for a value that must be right (a setting, a saved state's
  field, a command-line value): the value, or ``InvalidNumber`` saying which field and why.
* ``parse_number``/``parse_integer``: the same from text (environment variables, CLI strings).
* ``loads``: ``json.loads`` for untrusted text: a non-finite number is not JSON, too deep a
  nesting or a number too long to convert is a ``ValueError``, never another exception.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any

MAX_INT64 = 2**63 - 1
# Unix seconds from 1970 to the last second of year 9999 (what datetime can show).
MAX_UNIX_TIME = 253402300799.0
# The longest duration slurmft takes from outside (~11.6 days: a timeout, a step, a save): every
# wait it can become is one Python accepts (a subprocess's timeout goes to poll(2) as a C int of
# milliseconds, 24.8 days at most; ``subprocess.run(timeout=1e9)`` raises OverflowError).
MAX_SECONDS = 1e6


@dataclass(frozen=True)
class Range:
    """The range a number field of a record may hold (``Annotated`` metadata, read by
    ``slurmft.records``); a bare ``float`` field is any finite number, a bare ``int`` a count."""

    lo: float
    hi: float
    what: str = ""  # how a message names the range ("a unix time"); else "a number from lo to hi"

    def wanted(self) -> str:
        return self.what or f"a number from {self.lo:g} to {self.hi:g}"


# Field types of records read from outside: plain floats to mypy, checked by range on reading.
UnixTime = Annotated[float, Range(0.0, MAX_UNIX_TIME, "a unix time (seconds since 1970, before year 10000)")]
Seconds = Annotated[float, Range(0.0, MAX_SECONDS, f"a number of seconds from 0 to {MAX_SECONDS:g}")]


class InvalidNumber(ValueError):
    """A value from outside is not a number fit for its use; the message names the field."""

    def __init__(self, field: str, value: Any, wanted: str) -> None:
        super().__init__(f"{field} must be {wanted}, got {shown(value)}")
        self.field = field


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 4000-digit number is not printed whole)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr (more than 4300 digits)
        text = f"<an integer of more than {limit} digits>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _bounds(lo: float | None, hi: float | None, integral: bool) -> str:
    """"an integer", "a number from 0 to 10", "a number >= 1"... (int64's own ends go unsaid)."""
    kind = "an integer" if integral else "a number"
    if integral:
        lo = None if lo is not None and lo <= -MAX_INT64 else lo
        hi = None if hi is not None and hi >= MAX_INT64 else hi
        if lo is None and hi is None:
            return f"an integer that fits 64 bits (at most {MAX_INT64} in size)"
    if lo is not None and hi is not None:
        return f"{kind} from {lo:g} to {hi:g}"
    if lo is not None:
        return f"{kind} >= {lo:g}"
    if hi is not None:
        return f"{kind} <= {hi:g}"
    return kind


# ----------------------------------------------------------------------------- lenient


def finite(value: Any, lo: float | None = None, hi: float | None = None) -> float | None:
    """A JSON/TOML number (an int or float, not a bool) as a finite float within [lo, hi]; else
    None (a string, NaN, infinity, an integer too large for a float, out of range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    if not math.isfinite(number) or (lo is not None and number < lo) or (hi is not None and number > hi):
        return None
    return number


def whole(value: Any, lo: int | None = None, hi: int | None = MAX_INT64) -> int | None:
    """A JSON/TOML integer (not a bool, not a float) within [lo, hi] (default: int64's top); else None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        return None
    return value


def unix_time(value: Any) -> float | None:
    """A point in time in unix seconds (1970 to year 9999), else None."""
    return finite(value, 0.0, MAX_UNIX_TIME)


def seconds(value: Any) -> float | None:
    """A duration in seconds (0 to ``MAX_SECONDS``), else None."""
    return finite(value, 0.0, MAX_SECONDS)


def count(value: Any) -> int | None:
    """A step, restart count, size or other count (0 to int64's top), else None."""
    return whole(value, 0, MAX_INT64)


# ----------------------------------------------------------------------------- strict


def _wanted(lo: float | None, hi: float | None, above: bool) -> str:
    if above and lo is not None:
        return f"> {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
    return _bounds(lo, hi, False)


def number(value: Any, field: str, *, lo: float | None = None, hi: float | None = None,
           above: bool = False) -> float:
    """``value`` as a finite float within [lo, hi] (``above``: strictly above ``lo``), else
    ``InvalidNumber`` naming ``field``."""
    result = finite(value, lo, hi)
    if result is None or (above and lo is not None and result <= lo):
        a_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        raise InvalidNumber(field, value, _wanted(lo, hi, above) if a_number else "a number")
    return result


def integer(value: Any, field: str, *, lo: int | None = None, hi: int | None = MAX_INT64) -> int:
    """``value`` as an int within [lo, hi], else ``InvalidNumber`` naming ``field``."""
    result = whole(value, lo, hi)
    if result is None:
        an_int = isinstance(value, int) and not isinstance(value, bool)
        raise InvalidNumber(field, value, _bounds(lo, hi, True) if an_int else "an integer")
    return result


def parse_number(text: str, field: str, *, lo: float | None = None, hi: float | None = None,
                 above: bool = False) -> float:
    """A number written as text (an environment variable, a CLI value): like :func:`number`."""
    try:
        value: Any = float(text.strip())
    except (ValueError, AttributeError):
        value = text
    if isinstance(value, str):
        raise InvalidNumber(field, text, "a number")
    try:
        return number(value, field, lo=lo, hi=hi, above=above)
    except InvalidNumber:
        raise InvalidNumber(field, text, _wanted(lo, hi, above)) from None


def parse_integer(text: str, field: str, *, lo: int | None = None, hi: int | None = MAX_INT64) -> int:
    """A whole number written as text: like :func:`integer` (at most 4300 digits are parsed)."""
    try:
        value: Any = int(text.strip())
    except (ValueError, AttributeError):
        raise InvalidNumber(field, text, "an integer") from None
    try:
        return integer(value, field, lo=lo, hi=hi)
    except InvalidNumber:
        raise InvalidNumber(field, text, _bounds(lo, hi, True)) from None


# ----------------------------------------------------------------------------- JSON


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is too large for a number")
    return value


def loads(data: str | bytes) -> Any:
    """JSON from outside: ``NaN``, ``Infinity`` and a float too large to be finite (``1e400``) are
    refused like any other invalid JSON; too deep a nesting and an integer too long to convert
    are a ``ValueError`` too. What it returns holds no non-finite float."""
    try:
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def dumps(obj: Any, **kwargs: Any) -> str:
    """The JSON slurmft prints: always valid JSON. A float that is not finite (which no reader
    here lets in; this is the last guard) is written ``null``, never ``NaN`` or ``Infinity``."""
    return json.dumps(_plain(obj), allow_nan=False, **kwargs)
