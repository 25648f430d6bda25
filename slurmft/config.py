"""One typed configuration: defaults < slurmft.toml < environment < CLI flags.

Each component owns a frozen dataclass of its settings (``SweepConfig``, ``CheckpointConfig``...)
and registers nothing here: this module only knows how to fill a dataclass from a mapping,
validating every value in one place. Errors name the offending key (``[sweep] max_drain_share``)
and unknown keys are rejected with the list of valid ones.

Layering:
  * defaults are the dataclass defaults;
  * ``slurmft.toml``: the file named by ``--config`` or ``$SLURMFT_CONFIG``, else ``./slurmft.toml``
    when present; one TOML table per component (``[sweep]``, ``[checkpoint]``...); a table that
    is not in ``SECTIONS`` is rejected (a misspelt ``[sweeep]`` must not be silently ignored);
  * environment: ``SLURMFT_<SECTION>_<FIELD>`` (upper case), parsed as the field's type; only
    these strings are split on commas for list fields (a TOML list stays a list, and a TOML string
    given for a list field is an error); a variable naming the loaded section and a field it
    does not have is rejected with the valid ones;
  * CLI flags: passed by the command as ``overrides`` (``None`` means "not given").

Root never reads a config from its working directory: as root, the file is the explicit one
(``--config`` / ``$SLURMFT_CONFIG``) or ``SYSTEM_CONFIG``, and it must be owned by root and not
writable by others, nor may any directory above it be (the config names commands that the
sweeper runs as root).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from slurmft import numbers

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

T = TypeVar("T", bound="DataclassInstance")  # a dataclass: every section is one

CONFIG_ENV = "SLURMFT_CONFIG"
DEFAULT_CONFIG_NAME = "slurmft.toml"
SYSTEM_CONFIG = Path("/etc/slurmft/slurmft.toml")

# Every table slurmft.toml may hold, one per component's config dataclass. A component that
# adds a section adds its name here (tests/unit/test_config.py checks every load_section call).
SECTIONS = ("checkpoint", "guards", "health_dcgm", "health_external", "health_gpu",
            "health_node", "health_xid", "journal", "loop", "preemption", "slurm", "sweep", "watch")


class ConfigError(ValueError):
    """A configuration value, key or file is wrong; the message names it."""


def find_config_file(explicit: str | os.PathLike[str] | None = None, *,
                     root: bool | None = None) -> Path | None:
    """The config file to read: explicit path, then $SLURMFT_CONFIG, then ./slurmft.toml if
    present (as root: ``SYSTEM_CONFIG`` if present, never the working directory). ``root``
    defaults to whether this process runs as root; as root the file must pass
    ``check_root_owned``."""
    if root is None:
        root = os.geteuid() == 0
    path: Path | None = None
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
    elif os.environ.get(CONFIG_ENV):
        path = Path(os.environ[CONFIG_ENV])
        if not path.is_file():
            raise ConfigError(f"config file {path} (from ${CONFIG_ENV}) does not exist")
    else:
        default = SYSTEM_CONFIG if root else Path(DEFAULT_CONFIG_NAME)
        path = default if default.is_file() else None
    if root and path is not None:
        check_root_owned(path)
    return path


def check_root_owned(path: Path) -> None:
    """A file root may read its config from: it and every directory above it owned by root and
    not writable by group or others (a sticky directory such as /tmp excepted); else whoever
    can write there could make root's sweeper run their commands."""
    real = Path(os.path.realpath(path))
    for where in (real, *real.parents):
        st = os.stat(where)
        sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        if st.st_uid != 0:
            raise ConfigError(f"config file {path}: {where} is owned by uid {st.st_uid}; as root, "
                              "slurmft reads only a config that root owns, in directories root owns")
        if st.st_mode & 0o022 and not sticky_dir:
            raise ConfigError(f"config file {path}: {where} is writable by group or others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}); as root, slurmft reads only "
                              "a config that no one else can change")


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a syntax error becomes a ConfigError naming the file."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:  # a number too long to convert, nesting too deep
        raise ConfigError(f"config file {path}: unreadable value ({' '.join(str(exc).split())[:120]})") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None


def load_section(
    cls: type[T],
    section: str,
    *,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from its defaults, the ``[section]`` table, the environment and overrides."""
    values: dict[str, Any] = {}
    path = find_config_file(config_file)
    if path is not None:
        document = read_toml(path)
        check_sections(document, path, also=section)
        table = document.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] in {path} must be a table")
        values.update(table)
    env = os.environ if environ is None else environ
    names = {f.name for f in dataclasses.fields(cls)}
    from_env = set()
    for key, field in section_env(env, section):
        if field not in names:
            raise ConfigError(f"{key}: [{section}] has no key {field!r}; valid keys: "
                              f"{', '.join(sorted(names))} (as SLURMFT_{section.upper()}_<KEY>)")
        values[field] = env[key]
        from_env.add(field)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
            from_env.discard(key)
    return from_mapping(cls, values, section, env_keys=frozenset(from_env))


def check_sections(document: Mapping[str, Any], path: Path, also: str = "") -> None:
    """Every top-level key of a config file is a known section (``also``: the one being loaded)."""
    valid = sorted({*SECTIONS, also} - {""})
    for key in document:
        if key not in valid:
            raise ConfigError(f"config file {path}: unknown section [{key}]; valid sections: "
                              f"{', '.join(valid)}")


def section_env(env: Mapping[str, str], section: str) -> list[tuple[str, str]]:
    """(variable, field) for each ``SLURMFT_<SECTION>_<FIELD>`` of ``section``; a variable of a
    longer section name with the same start (``health`` vs ``health_gpu``) is not its."""
    prefix = f"SLURMFT_{section.upper()}_"
    longer = [f"SLURMFT_{s.upper()}_" for s in SECTIONS
              if s != section and s.upper().startswith(f"{section.upper()}_")]
    return [(key, key[len(prefix):].lower()) for key in sorted(env)
            if key.startswith(prefix) and not any(key.startswith(p) for p in longer)]


def from_mapping(cls: type[T], data: Mapping[str, Any], section: str, *,
                 env_keys: frozenset[str] = frozenset()) -> T:
    """Validate ``data`` against dataclass ``cls``; every error names ``[section] key``.

    ``env_keys``: the keys whose values are environment strings (lists are comma-separated there).
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"[{section}] unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {name: coerce(value, hints[name], f"[{section}] {name}", from_env=name in env_keys)
              for name, value in data.items()}
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"[{section}] {exc}") from None
    return obj


def _is_numeric(value: Any) -> bool:
    """A number, or text Python reads as one (``inf`` and ``nan`` included)."""
    try:
        float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def coerce(value: Any, hint: Any, where: str, *, from_env: bool = False) -> Any:
    """Convert a TOML/env value to the annotated type, or raise ConfigError naming ``where``.

    ``from_env``: ``value`` is an environment string, where a list is written ``a,b,c`` and
    numbers and booleans are spelled out; from TOML or a caller they must already have their type.
    """
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where, from_env=from_env)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"{where} must be one of {', '.join(map(repr, args))}, got {value!r}")
    if origin in (tuple, list):
        if from_env and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {type(value).__name__}")
        item = args[0] if args else Any
        return tuple(coerce(v, item, f"{where}[{i}]", from_env=from_env) for i, v in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {type(value).__name__}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        spelled = value.lower() if from_env and isinstance(value, str) else None
        if spelled in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return spelled in ("1", "true", "yes", "on")
        raise ConfigError(f"{where} must be a boolean, got {value!r}")
    # Numbers go through slurmft.numbers: an int fits int64; a float is finite (TOML's inf and
    # nan, an environment's "1e400", an int too large for a float are refused) and at most
    # MAX_SECONDS in size, so no setting can overflow a wait or a timeout; each section's
    # __post_init__ checks its own range within that.
    if hint is int:
        try:
            if from_env and isinstance(value, str):
                return numbers.parse_integer(value, where, lo=-numbers.MAX_INT64)
            return numbers.integer(value, where, lo=-numbers.MAX_INT64)
        except numbers.InvalidNumber as exc:
            raise ConfigError(str(exc)) from None
    if hint is float:
        try:
            if from_env and isinstance(value, str):
                number = numbers.parse_number(value, where)
            else:
                number = numbers.number(value, where)
        except numbers.InvalidNumber as exc:
            numeric = (isinstance(value, (int, float)) and not isinstance(value, bool)) or \
                (from_env and isinstance(value, str) and _is_numeric(value))
            raise ConfigError(str(exc).replace("must be a number", "must be a finite number")
                              if numeric else str(exc)) from None
        if abs(number) > numbers.MAX_SECONDS:
            raise ConfigError(f"{where} must be at most {numbers.MAX_SECONDS:g} in size, got {numbers.shown(value)}")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    if hint is Path:
        # "" would be Path("."): the working directory, which is never what a setting means.
        if isinstance(value, (str, Path)) and str(value).strip() and "\0" not in str(value):
            return Path(value)
        if isinstance(value, (str, Path)):
            raise ConfigError(f"{where} must be a non-empty path without NUL bytes, got {str(value)!r}")
        raise ConfigError(f"{where} must be a path string, got {value!r}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a dataclass type (never an instance)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {type(value).__name__}")
        # "[sweep] checks[0]" -> section "sweep.checks[0]", so nested errors read "[sweep.checks[0]] key".
        return from_mapping(hint, value, where.lstrip("[").replace("] ", ".", 1))
    return value
