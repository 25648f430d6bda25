"""A throwaway REAL Slurm cluster on one machine (munge, MariaDB + slurmdbd, slurmctld, N slurmd
on 127.0.0.1) in one directory: the test bed for every integration test and for ``make demo``.

Modules: ``layout`` (paths, state file), ``ports`` (free port blocks), ``release`` (binaries,
versions, release differences), ``render`` (config text), ``hosts`` (/etc/hosts block),
``procs``/``nodeprocs`` (process table, node process trees), ``daemons`` (start and wait),
``query`` (controller queries), ``settle`` (what ``reset`` does per node state), ``cluster`` (the ``DevCluster`` handle).
"""

from slurmft.slurm.devcluster.cluster import DEFAULT_NODES, MAX_NODES, DevCluster
from slurmft.slurm.devcluster.errors import DevClusterError

__all__ = ["DEFAULT_NODES", "MAX_NODES", "DevCluster", "DevClusterError"]
