"""The installed software a devcluster runs: where each binary is, which releases, and every
difference between releases that the devcluster has to care about (kept here and nowhere else).

Binaries are found with ``shutil.which`` on PATH plus the sbin directories (a debootstrap chroot
of another Debian release puts them in the usual places, but nothing here assumes that).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping

from slurmft.slurm.devcluster.errors import DevClusterError

DAEMON_ENV_VAR = "SLURMFT_DEVCLUSTER_DAEMON_ENV"
INSTALL_HINT = "apt-get install slurm-wlm slurmdbd munge mariadb-server (or: make install)"
VERSION_TIMEOUT_S = 15.0

# name in Binaries -> candidate executable names, first found wins.
_PROGRAMS: dict[str, tuple[str, ...]] = {
    "slurmctld": ("slurmctld",),
    "slurmd": ("slurmd",),
    "slurmdbd": ("slurmdbd",),
    "munged": ("munged",),
    "mariadbd": ("mariadbd", "mysqld"),
    "mariadb_install_db": ("mariadb-install-db", "mysql_install_db"),
    "mariadb": ("mariadb", "mysql"),
    "sinfo": ("sinfo",),
    "squeue": ("squeue",),
    "scontrol": ("scontrol",),
    "scancel": ("scancel",),
}


def _search_path() -> str:
    parts = os.environ.get("PATH", "").split(os.pathsep)
    for extra in ("/usr/local/sbin", "/usr/sbin", "/sbin"):
        if extra not in parts:
            parts.append(extra)
    return os.pathsep.join(p for p in parts if p)


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every program the devcluster runs."""

    slurmctld: str
    slurmd: str
    slurmdbd: str
    munged: str
    mariadbd: str
    mariadb_install_db: str
    mariadb: str
    sinfo: str
    squeue: str
    scontrol: str
    scancel: str

    @classmethod
    def find(cls) -> "Binaries":
        """Locate every program; one error listing all that are missing, with the install hint."""
        path = _search_path()
        found: dict[str, str] = {}
        missing: list[str] = []
        for field_name, names in _PROGRAMS.items():
            hit = next((p for p in (shutil.which(n, path=path) for n in names) if p), None)
            if hit is None:
                missing.append(names[0])
            else:
                found[field_name] = hit
        if missing:
            raise DevClusterError(f"missing program(s): {', '.join(missing)}; {INSTALL_HINT}")
        return cls(**found)


def parse_version(text: str) -> tuple[int, int, int]:
    """``slurm-wlm 22.05.8`` / ``slurm 24.11.5`` / ``mariadbd  Ver 10.11.19-MariaDB`` -> ints."""
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    if match is None:
        raise DevClusterError(f"cannot read a version from {text.strip()!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def program_version(binary: str, flag: str) -> tuple[int, int, int]:
    try:
        out = subprocess.run([binary, flag], capture_output=True, text=True,
                             timeout=VERSION_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DevClusterError(f"{binary} {flag} failed: {exc}") from None
    return parse_version(out.stdout + out.stderr)


def slurm_version(binaries: Binaries) -> tuple[int, int, int]:
    return program_version(binaries.slurmctld, "-V")


def mariadb_version(binaries: Binaries) -> tuple[int, int, int]:
    return program_version(binaries.mariadbd, "--version")


def mariadbd_release_args(mariadb: tuple[int, int, int]) -> list[str]:
    """MariaDB 11.6.2 turned innodb_snapshot_isolation ON by default; slurmdbd's transactions
    then fail (measured with sid's 11.8), so switch it back off where the default changed."""
    if mariadb >= (11, 6, 2):
        return ["--innodb-snapshot-isolation=OFF"]
    return []


def daemon_env_from_pairs(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["LD_LIBRARY_PATH=/x", ...]`` -> dict; a malformed entry is an error naming it."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise DevClusterError(f"daemon environment entry {pair!r} is not KEY=VALUE")
        env[key] = value
    return env


def daemon_env_from_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """Extra daemon environment from ``$SLURMFT_DEVCLUSTER_DAEMON_ENV`` (whitespace-separated
    KEY=VALUE pairs), used when the caller passes none: e.g. the test matrix's sid chroot sets
    ``LD_LIBRARY_PATH`` for slurmdbd this way."""
    return daemon_env_from_pairs(environ.get(DAEMON_ENV_VAR, "").split())


def version_string(version: tuple[int, int, int]) -> str:
    """(22, 5, 8) -> ``22.05.8``, the way Slurm spells its releases."""
    major, minor, patch = version
    return f"{major}.{minor:02d}.{patch}"
