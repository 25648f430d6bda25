"""slurmft.slurm: the only package that talks to Slurm (see ``client.py`` for the contract).

``get_client()`` (``backend.py``) picks the backend: pyslurm when it matches the running Slurm,
else ``CliSlurmClient`` (``cli.py``); settings are ``SlurmConfig`` (``[slurm]`` in slurmft.toml).
Importing this package runs nothing.
"""

from slurmft.slurm.client import (
    InvalidArgument,
    Job,
    JobNotFound,
    JobState,
    Node,
    NodeState,
    PermissionDenied,
    SlurmClient,
    SlurmError,
    SlurmInfo,
    SlurmUnavailable,
    UnsupportedShape,
)
from slurmft.slurm.config import SlurmConfig
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.backend import get_client

__all__ = [
    "InvalidArgument", "Job", "JobNotFound", "JobState", "Node", "NodeState", "PermissionDenied",
    "SlurmClient", "SlurmError", "SlurmInfo", "SlurmUnavailable", "UnsupportedShape",
    "CliSlurmClient", "SlurmConfig", "get_client",
]
