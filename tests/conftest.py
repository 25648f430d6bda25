"""Shared pytest fixtures: ONE real devcluster (n1..n4) for the whole test run.

``devcluster`` (session) starts it in a temp dir on first use and always takes it down: in the
fixture's ``finally`` and, should the run be interrupted before that runs, from ``atexit``.
``slurm_cluster`` (function) is the same cluster after ``reset()``: no jobs, every node IDLE.
``forgetful_cluster`` (function) is a dedicated 1-node cluster of its own whose controller forgets
an ended job within seconds (a short MinJobAge), taken down after the test.
Integration tests are skipped only when this machine cannot run a devcluster at all (not root,
or Slurm/munge/MariaDB programs missing); any other failure to start is an error.
"""

from __future__ import annotations

import atexit
import functools
import os
from typing import Iterator

import pytest

from slurmft.slurm.devcluster import DevCluster, DevClusterError
from slurmft.slurm.devcluster.release import Binaries

SESSION_NODES = 4
# MinJobAge of forgetful_cluster. Measured on 22.05.8, from the end of a job to the controller's
# "Invalid job id": 3.7-4.4 s with MinJobAge=2, 5-13 s with 5, 14 s with 10, 44 s with 25.
FORGETFUL_MIN_JOB_AGE_S = 5


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--keep-devcluster", action="store_true", default=False,
                     help="leave the session devcluster running after the tests (prints where)")


def devcluster_unavailable() -> str | None:
    """Why this machine cannot run a devcluster, or None when it can."""
    if os.geteuid() != 0:
        return "devcluster needs root"
    try:
        Binaries.find()
    except DevClusterError as exc:
        return str(exc)
    return None


def _down_quietly(cluster: DevCluster) -> None:
    if cluster.is_running():
        try:
            cluster.down()
        except DevClusterError as exc:
            print(f"devcluster teardown: {exc}")


@pytest.fixture(scope="session")
def devcluster(tmp_path_factory: pytest.TempPathFactory,
               request: pytest.FixtureRequest) -> Iterator[DevCluster]:
    reason = devcluster_unavailable()
    if reason is not None:
        pytest.skip(f"no devcluster on this machine: {reason}")
    cluster = DevCluster.up(tmp_path_factory.mktemp("devcluster"), nodes=SESSION_NODES)
    keep = request.config.getoption("--keep-devcluster")
    if not keep:
        atexit.register(_down_quietly, cluster)
    try:
        yield cluster
    finally:
        if keep:
            print(f"\ndevcluster kept running in {cluster.dir}:\n{cluster.exports()}")
        else:
            _down_quietly(cluster)


@pytest.fixture
def slurm_cluster(devcluster: DevCluster) -> DevCluster:
    devcluster.reset()
    return devcluster


@pytest.fixture
def forgetful_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """Its own cluster, so that the short MinJobAge touches no other test's jobs (a short path:
    munged's socket lives under it)."""
    reason = devcluster_unavailable()
    if reason is not None:
        pytest.skip(f"no devcluster on this machine: {reason}")
    cluster = DevCluster.up(tmp_path_factory.mktemp("forgetful"), nodes=1,
                            min_job_age_s=FORGETFUL_MIN_JOB_AGE_S)
    stop = functools.partial(_down_quietly, cluster)  # its own: unregister leaves the session's
    atexit.register(stop)
    try:
        yield cluster
    finally:
        stop()
        atexit.unregister(stop)
