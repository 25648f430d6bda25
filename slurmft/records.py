"""A record from outside, checked whole, field by field, before anything acts on it.

A record that someone else can write (the watcher's ``watch/state.json`` in the run owner's
directory) is read into a dataclass with ``cls(**data)``, which checks names but no types: a
recovery time that is a string, a list of nodes that is a number, a count of 400 digits all get
in, and fail later, every cycle, in the code that trusts them. :func:`check` walks the
dataclass's annotations and raises ``RecordError`` naming the first field that does not hold its
type, so a damaged record is refused as a whole, before use, never trusted half-way.

What each annotation means here: ``str``, ``bool``; ``int`` is a count (0 to int64's top);
``float`` any finite number, and ``numbers.UnixTime`` / ``numbers.Seconds`` (``Annotated`` with a
``numbers.Range``) one within that range; ``X | None``; ``list[X]`` / ``tuple[X, ...]`` (a JSON
array); ``dict[str, X]``; ``Literal[...]``; a nested dataclass (checked the same way). ``Any``
and other types are not checked.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Literal, Union

from slurmft import numbers
from slurmft.numbers import Range


class RecordError(ValueError):
    """A record's field does not hold its type; the message names the record and the field."""


def check(obj: Any, where: str) -> None:
    """Every field of dataclass instance ``obj`` holds its annotated type (``RecordError`` else)."""
    problem = _record_problem(obj)
    if problem is not None:
        raise RecordError(f"{where}: field {problem}")


def _record_problem(obj: Any) -> str | None:
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        problem = _problem(value, hints[field.name])
        if problem is not None:
            return _join(field.name, problem)
    return None


def _join(name: str, problem: str) -> str:
    """``exclude`` + ``[1] must be...`` -> ``exclude[1] must be...``; + ``must be`` -> with a space."""
    return f"{name}{'' if problem.startswith(('.', '[')) else ' '}{problem}"


def _problem(value: Any, hint: Any) -> str | None:
    """Why ``value`` does not hold type ``hint`` (None when it does)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        base, meta = args[0], args[1:]
        bounds = next((m for m in meta if isinstance(m, Range)), None)
        if bounds is not None and base is float:
            if numbers.finite(value, bounds.lo, bounds.hi) is None:
                return f"must be {bounds.wanted()}, got {numbers.shown(value)}"
            return None
        return _problem(value, base)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        problems = [_problem(value, arg) for arg in args if arg is not type(None)]
        return None if any(p is None for p in problems) else problems[0]
    if origin is Literal:
        if any(value == arg and type(value) is type(arg) for arg in args):
            return None
        return f"must be one of {', '.join(map(repr, args))}, got {numbers.shown(value)}"
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return f"must be a list, got {numbers.shown(value)}"
        item = args[0] if args else Any
        for i, element in enumerate(value):
            problem = _problem(element, item)
            if problem is not None:
                return _join(f"[{i}]", problem)
        return None
    if origin is dict:
        if not isinstance(value, dict):
            return f"must be an object, got {numbers.shown(value)}"
        item = args[1] if len(args) == 2 else Any
        for key, element in value.items():
            if not isinstance(key, str):
                return f"must have string keys, got {numbers.shown(key)}"
            problem = _problem(element, item)
            if problem is not None:
                return _join(f"[{key[:40]!r}]", problem)
        return None
    if hint is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {numbers.shown(value)}"
    if hint is int:
        return None if numbers.count(value) is not None else \
            f"must be a whole number from 0 to {numbers.MAX_INT64}, got {numbers.shown(value)}"
    if hint is float:
        return None if numbers.finite(value) is not None else f"must be a finite number, got {numbers.shown(value)}"
    if hint is str:
        return None if isinstance(value, str) else f"must be a string, got {numbers.shown(value)}"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            return f"must be an object, got {numbers.shown(value)}"
        problem = _record_problem(value)
        return None if problem is None else f".{problem}"
    return None
