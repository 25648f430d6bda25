"""The devcluster's daemons run in the cluster's own directory, not the caller's (a crashing
slurmstepd leaves `core` files in its cwd, and HealthCheckProgram runs there)."""

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_every_daemon_runs_in_the_cluster_directory(slurm_cluster):
    procs = slurm_cluster.processes()
    assert procs
    root = slurm_cluster.dir.resolve()
    for name, proc in procs.items():
        cwd = Path(os.readlink(f"/proc/{proc.pid}/cwd"))
        assert cwd == root or root in cwd.parents, f"{name} runs in {cwd}"  # mariadbd: its datadir
