"""The launcher's settings, every one read from the environment once and validated here.

A number that does not parse, is not finite, or is outside its range is an error naming the
variable (``SLURMFT_RESIGNAL_S=abc`` once made a loop call ``scancel`` 110 times a second).
Every period of a loop that reaches Slurm has a floor (``MIN_RESIGNAL_S``, ``MIN_SWEEP_RETRY_S``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from slurmft import numbers
from slurmft.launch import warm
from slurmft.launch.identity import JobIdentity
from slurmft.rundir import RUN_DIR_ENV


class SettingsError(ValueError):
    """A launcher setting in the environment is wrong; the message names the variable."""


MIN_RESIGNAL_S = 1.0        # a re-sent USR2 costs one RPC per node of the step
MIN_SWEEP_RETRY_S = 0.5     # retry period while another sweep holds a node's lock
MIN_PREFLIGHT_TIMEOUT_S = 10.0
# Names are chosen outside config.SECTIONS: a SLURMFT_SWEEP_<X> variable would be read (and, X
# not being a [sweep] field, rejected) by the sweep that the pre-flight runs in this environment.
# The comment token ``SLURMFT_RUN_DIR=<dir>`` ends at whitespace or a comma (parse_jobs.py).
_UNSAFE_PATH = re.compile(r"[\s,\x00-\x1f\x7f]")


@dataclass(frozen=True)
class LaunchSettings:
    run_dir: Path
    nproc_per_node: int
    min_free_gb: float
    pg_timeout_s: int
    resignal_s: float
    preflight_timeout_s: float
    sweep_wait_s: float
    sweep_fresh_s: float
    warm_workers: bool = True   # ranks forked from each node's warm server (warm.py), both modes


def _number(env: Mapping[str, str], name: str, default: float, *, minimum: float,
            maximum: float = 1e9, integer: bool = False) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    kind = "an integer" if integer else "a number"
    try:
        value: float = (numbers.parse_integer(raw, name) if integer
                        else numbers.parse_number(raw, name))
    except numbers.InvalidNumber:  # not a number at all, or "inf", "nan", "1e400"
        value = math.nan
        if not _numeric(raw, integer):
            raise SettingsError(f"{name}={numbers.shown(raw)} must be {kind}") from None
    if not math.isfinite(value) or not minimum <= value <= maximum:
        raise SettingsError(f"{name}={numbers.shown(raw)} must be between {minimum:g} and {maximum:g}")
    return value


def _numeric(raw: str, integer: bool) -> bool:
    """Whether ``raw`` is written as a number (inf, nan and 400 digits are: out of range)."""
    try:
        int(raw.strip()) if integer else float(raw.strip())
    except ValueError:
        return False
    return True


def run_dir_for(raw: str | None, identity: JobIdentity) -> Path:
    """``SLURMFT_RUN_DIR`` with ``%A``/``%a`` (array job id / task id, as in sbatch's file names)
    replaced. Whether two array tasks (or jobs) share the directory is judged on disk, not from
    the spelling: the launcher claims the run dir (``launch/claim.py``)."""
    if raw is None or raw == "":
        raise SettingsError(f"{RUN_DIR_ENV} is not set: export it (the run directory on the shared "
                            "filesystem) before sbatch")
    if not raw.startswith("/"):
        raise SettingsError(f"{RUN_DIR_ENV}={raw} must be an absolute path")
    if _UNSAFE_PATH.search(raw):
        raise SettingsError(f"{RUN_DIR_ENV}={raw!r} must not contain spaces, commas or control "
                            "characters (it is written into the job comment)")
    if identity.is_array_task:
        raw = raw.replace("%A", identity.array_job_id or "").replace("%a", identity.array_task_id or "")
    elif "%a" in raw or "%A" in raw:
        raise SettingsError(f"{RUN_DIR_ENV}={raw} uses %a/%A but this is not an array job")
    return Path(raw)


def from_environ(env: Mapping[str, str], identity: JobIdentity) -> LaunchSettings:
    try:   # SLURMFT_WARM_WORKERS=0: every rank starts cold; unset or 1: warm (``warm``)
        warm_asked, _ = warm.settings(env)
    except warm.WarmSettingsError as exc:
        raise SettingsError(str(exc)) from None
    gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    default_nproc = int(gpus) if gpus.isascii() and gpus.isdigit() and int(gpus) > 0 else 1
    return LaunchSettings(
        run_dir=run_dir_for(env.get(RUN_DIR_ENV), identity),
        nproc_per_node=int(_number(env, "SLURMFT_NPROC_PER_NODE", default_nproc, minimum=1,
                                   maximum=1024, integer=True)),
        min_free_gb=_number(env, "SLURMFT_MIN_FREE_GB", 1.0, minimum=0, maximum=1e6),
        pg_timeout_s=int(_number(env, "SLURMFT_PG_TIMEOUT_S", 600, minimum=1, maximum=86400 * 7,
                                 integer=True)),
        resignal_s=_number(env, "SLURMFT_RESIGNAL_S", 5.0, minimum=MIN_RESIGNAL_S, maximum=3600),
        preflight_timeout_s=_number(env, "SLURMFT_PREFLIGHT_TIMEOUT_S", 180.0,
                                    minimum=MIN_PREFLIGHT_TIMEOUT_S, maximum=3600),
        sweep_wait_s=_number(env, "SLURMFT_PREFLIGHT_SWEEP_WAIT_S", 60.0, minimum=0, maximum=3600),
        sweep_fresh_s=_number(env, "SLURMFT_PREFLIGHT_SWEEP_FRESH_S", 300.0, minimum=0, maximum=86400),
        warm_workers=warm_asked is not False,
    )
