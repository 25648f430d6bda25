"""slurmft.slurm: the only package that talks to Slurm (see ``client.py`` for the contract).

``CliSlurmClient`` (``cli.py``) is the command-line backend. Importing this package runs nothing.
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

__all__ = [
    "InvalidArgument", "Job", "JobNotFound", "JobState", "Node", "NodeState", "PermissionDenied",
    "SlurmClient", "SlurmError", "SlurmInfo", "SlurmUnavailable", "UnsupportedShape",
]
