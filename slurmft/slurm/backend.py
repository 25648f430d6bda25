"""Which SlurmClient to use: pyslurm when it imports AND was built for the running Slurm's
major.minor (pyslurm only builds against one release), else the CLI backend -- silently, unless
``[slurm] backend = "pyslurm"`` asked for it explicitly (then a mismatch is an error).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Mapping

from slurmft.config import load_section
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import SlurmClient, SlurmError
from slurmft.slurm.config import SlurmConfig
from slurmft.slurm.release import parse_version


def import_pyslurm() -> ModuleType | None:
    try:
        return importlib.import_module("pyslurm")
    except ImportError:
        return None


def pyslurm_unusable(module: ModuleType | None, running: tuple[int, int, int],
                     env: Mapping[str, str] | None) -> str | None:
    """Why pyslurm cannot serve this Slurm (None when it can)."""
    if module is None:
        return "pyslurm is not installed"
    built_for = parse_version(str(getattr(module, "__version__", "")))
    if built_for is None:
        return f"pyslurm reports no usable version ({getattr(module, '__version__', None)!r})"
    if built_for[:2] != running[:2]:
        return (f"pyslurm {module.__version__} is built for Slurm {built_for[0]}.{built_for[1]:02d}, "
                f"the running Slurm is {running[0]}.{running[1]:02d}")
    conf = (env or {}).get("SLURM_CONF")
    if conf and conf != os.environ.get("SLURM_CONF"):
        # libslurm reads SLURM_CONF of the process once; an overlay for one client cannot reach it.
        return "an environment overlay sets SLURM_CONF, which pyslurm cannot honour per client"
    return None


def get_client(config: SlurmConfig | None = None, *, env: Mapping[str, str] | None = None,
               module: ModuleType | None = None) -> SlurmClient:
    """The SlurmClient for this process (``config`` defaults to ``load_section(SlurmConfig, "slurm")``)."""
    config = config or load_section(SlurmConfig, "slurm")
    cli = CliSlurmClient(config, env=env)
    if config.backend == "cli":
        return cli
    module = module if module is not None else import_pyslurm()
    if module is None:
        reason: str | None = "pyslurm is not installed"
    else:
        reason = pyslurm_unusable(module, cli.info().version, env)
        if reason is None:
            from slurmft.slurm.pyslurm import PyslurmClient

            return PyslurmClient(module, config, cli=cli)
    if config.backend == "pyslurm":
        raise SlurmError(f'[slurm] backend = "pyslurm", but {reason}')
    return cli
