"""Shared pytest fixtures and the suite's scheduling: one real devcluster (n1..n4) per pytest
session, that is per xdist worker (``make test`` runs ``pytest -n N --dist loadgroup``).

``devcluster`` (session) is the worker's own cluster, started in the worker's temp dir just
before the worker's first test that uses it (a worker that runs none starts none), outside that
test's timeout and one worker at a time (``pytest_runtest_protocol``), and always taken down: in
the fixture's ``finally`` and, should the run be interrupted before that runs, from ``atexit``.
Clusters of different workers run side by side (own ports, dirs, MariaDB, /etc/hosts block).
``slurm_cluster`` (function) is the same cluster after ``reset()``: no jobs, every node IDLE; it
is reset again after the test, so that no job of it trains on beside the tests after it.
``forgetful_cluster`` (function) is a dedicated 1-node cluster of its own whose controller forgets
an ended job within seconds (a short MinJobAge), taken down after the test.
Integration tests are skipped only when this machine cannot run a devcluster at all (not root,
or Slurm/munge/MariaDB programs missing); any other failure to start is an error.

Scheduling (``pytest_collection_modifyitems``): the order is random (pytest-randomly shuffles
it with a seed it prints: ``--randomly-seed=N`` repeats an order, ``-p no:randomly``
keeps the file order), then the tests are sorted by their bound, longest first (their
``timeout`` mark; unmarked ones count as UNMARKED_BOUND_S; a ``mostly_waits`` one as if it were
MOSTLY_WAITS_BOUND_S): xdist hands tests out in that order, so the long ones start early instead
of ending the run alone, and the long ones that only sleep do not all start at once. Tests that
share a module-scoped fixture of their own module (an expensive world built once) are put in one
xdist group: one worker builds it once.
tests/integration/conftest.py has the rules an integration test follows under xdist.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

from slurmft.slurm.devcluster import DevCluster, DevClusterError
from slurmft.slurm.devcluster.release import Binaries

SESSION_NODES = 4
# MinJobAge of forgetful_cluster. Measured on 22.05.8, from the end of a job to the controller's
# "Invalid job id": 3.7-4.4 s with MinJobAge=2, 5-13 s with 5, 14 s with 10, 44 s with 25.
FORGETFUL_MIN_JOB_AGE_S = 5
# A test without a timeout mark runs under pytest.ini's (300 s) but is usually a quick one: it
# is scheduled as if its bound were this.
UNMARKED_BOUND_S = 30.0
# The scheduling bound of a ``mostly_waits`` test: among the 600 s ones, after the other long ones.
MOSTLY_WAITS_BOUND_S = 600.0
# The bound of a test cluster's start: a liveness bound for a loaded box (DevCluster.up's default,
# 120 s, is the interactive one).
UP_TIMEOUT_S = 300.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--keep-devcluster", action="store_true", default=False,
                     help="leave the session devcluster running after the tests (prints where)")


def worker_id() -> str:
    """``gw0``, ``gw1``... under xdist, ``main`` without it."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def _bound(item: pytest.Item) -> float:
    mark = item.get_closest_marker("timeout")
    if mark is None:
        return UNMARKED_BOUND_S
    value = mark.args[0] if mark.args else mark.kwargs.get("timeout", UNMARKED_BOUND_S)
    try:
        return float(value)
    except (TypeError, ValueError):
        return UNMARKED_BOUND_S


def _scheduling_bound(item: pytest.Item) -> float:
    """The bound the test is scheduled by: its own, but at most MOSTLY_WAITS_BOUND_S for a test
    marked ``mostly_waits``. The long tests all starting at once left the 2 cores a third idle
    for the run's first 5 minutes (s14a: 1.2-1.5 cores busy, 1.8-2.0 afterwards): three of the
    four workers slept in the demo, the time-limit test and the slow-steps test. A test that
    sleeps through most of its wall time is sent out a little later, beside the ones that use
    the CPU, and still ends long before the run does."""
    bound = _bound(item)
    if item.get_closest_marker("mostly_waits") is not None:
        return min(bound, MOSTLY_WAITS_BOUND_S)
    return bound


def _own_module_scoped_fixtures(item: pytest.Item) -> list[str]:
    """Names of the module/class/package-scoped fixtures ``item`` uses that its own module
    defines (not the conftests': those are cheap or per worker by design)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    module = item.nodeid.split("::", 1)[0]
    found = []
    for name, defs in info.name2fixturedefs.items():
        for fixdef in defs:
            if fixdef.scope in ("module", "class", "package") and fixdef.baseid.startswith(module):
                found.append(name)
    return found


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """After pytest-randomly's shuffle (a hook wrapper: it runs before every plain hook) and
    before xdist reads the groups (a plain hook, after this tryfirst one)."""
    del config
    for item in items:
        if item.get_closest_marker("xdist_group") is None and _own_module_scoped_fixtures(item):
            item.add_marker(pytest.mark.xdist_group(name=item.nodeid.split("::", 1)[0]))
    # Longest bound first (sorted() is stable: the random order stays within each bound).
    items[:] = sorted(items, key=lambda i: -_scheduling_bound(i))


class _GroupSuffix:
    """``--dist loadgroup`` tells xdist's controller a test's group by a "@name" suffix of its
    node id, which xdist 3.8 writes to ``item._nodeid``; pytest 9 keeps the id in ``item._id``,
    so the suffix was lost and no group held together (seen: the hostile-run-dir world built on
    three workers at once). Written again here, after xdist's hook, where it did not take."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in item.iter_markers("xdist_group")})
            suffix = "@" + "_".join(names)
            if not names or item.nodeid.endswith(suffix):
                continue
            if hasattr(item, "_id"):
                from _pytest.nodeid import NodeId  # pytest >= 9
                item._id = NodeId.parse(item.nodeid + suffix)
            else:
                item._nodeid = item.nodeid + suffix


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_GroupSuffix(), "slurmft-xdist-group-suffix")


def devcluster_unavailable() -> str | None:
    """Why this machine cannot run a devcluster, or None when it can."""
    if os.geteuid() != 0:
        return "devcluster needs root"
    try:
        Binaries.find()
    except DevClusterError as exc:
        return str(exc)
    return None


def _up_one_at_a_time(factory: pytest.TempPathFactory, directory: Path, **kwargs: Any) -> DevCluster:
    """``DevCluster.up`` holding a lock shared by this run's xdist workers: 4 clusters starting at
    once on a loaded 2-core box (4 MariaDB installs) ran past the start's bound; one at a time,
    each starts in its usual time while the other workers run tests."""
    root = factory.getbasetemp()
    shared = root.parent if worker_id() != "main" else root  # xdist: basetemp/popen-gwN
    with open(shared / "devcluster-up.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        return DevCluster.up(directory, timeout=UP_TIMEOUT_S, **kwargs)


def _down_quietly(cluster: DevCluster) -> None:
    if cluster.is_running():
        try:
            cluster.down()
        except DevClusterError as exc:
            print(f"devcluster teardown: {exc}")


_SESSION: dict[str, Any] = {}  # this worker's cluster ("cluster"), or why it could not start ("error")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Start the worker's cluster before its first test that uses it, outside that test's
    timeout (this wrapper is outside pytest-timeout's): the start has its own bound, and a quick
    test must not pay for it, least of all on a loaded box."""
    del nextitem
    wants = "devcluster" in getattr(item, "fixturenames", ())
    if wants and not _SESSION and devcluster_unavailable() is None:
        factory = item.config._tmp_path_factory  # type: ignore[attr-defined]
        try:
            _SESSION["cluster"] = _up_one_at_a_time(factory, factory.mktemp(f"devcluster-{worker_id()}"),
                                                    nodes=SESSION_NODES)
        except DevClusterError as exc:
            _SESSION["error"] = exc
    yield


@pytest.fixture(scope="session")
def devcluster(request: pytest.FixtureRequest) -> Iterator[DevCluster]:
    reason = devcluster_unavailable()
    if reason is not None:
        pytest.skip(f"no devcluster on this machine: {reason}")
    if "error" in _SESSION:
        raise _SESSION["error"]
    cluster: DevCluster = _SESSION["cluster"]
    keep = request.config.getoption("--keep-devcluster")
    if not keep:
        atexit.register(_down_quietly, cluster)
    try:
        yield cluster
    finally:
        if keep:
            print(f"\ndevcluster kept running in {cluster.dir}:\n{cluster.exports()}")
        # else: stopped in pytest_sessionfinish, outside every test's timeout. Here it ran in the
        # worker's last test's teardown, under that test's timeout: with two busy processes
        # beside the suite, stopping the daemons took longer than a unit test's 10 s.


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    del exitstatus
    cluster = _SESSION.get("cluster")
    if cluster is not None and not session.config.getoption("--keep-devcluster"):
        _down_quietly(cluster)


@pytest.fixture
def slurm_cluster(devcluster: DevCluster) -> Iterator[DevCluster]:
    devcluster.reset()
    yield devcluster
    # Reset after the test too: a test's jobs (and the training in them) ran on behind it until
    # the worker's next integration test, loading the 2-core box under every test in between
    # (a whole module, in a serial run: the hostile-run-dir runners then overran their bound).
    try:
        devcluster.reset()
    except DevClusterError as exc:  # the next test's reset says it again, as an error
        # A warning, not a print: captured stdout of a passed test is dropped under -q, and this
        # first error is the one that names the node's process and its state.
        warnings.warn(f"devcluster reset after the test: {exc}", stacklevel=1)


def _own_cluster(factory: pytest.TempPathFactory, name: str, **kwargs: Any) -> Iterator[DevCluster]:
    """A cluster of a test's own beside the worker's (skipped where none can run), started under
    the workers' shared lock and taken down after the test, or at exit if the worker dies first."""
    reason = devcluster_unavailable()
    if reason is not None:
        pytest.skip(f"no devcluster on this machine: {reason}")
    cluster = _up_one_at_a_time(factory, factory.mktemp(name), **kwargs)
    stop = functools.partial(_down_quietly, cluster)  # its own: unregister leaves the session's
    atexit.register(stop)
    try:
        yield cluster
    finally:
        stop()
        atexit.unregister(stop)


@pytest.fixture
def forgetful_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """Its own cluster, so that the short MinJobAge touches no other test's jobs (a short path:
    munged's socket lives under it)."""
    yield from _own_cluster(tmp_path_factory, "forgetful", nodes=1,
                            min_job_age_s=FORGETFUL_MIN_JOB_AGE_S)


@pytest.fixture
def slow_slurmd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """4 nodes with ``SlurmdTimeout=120``: Slurm's own detection of a dead node takes minutes
    here, as on a real cluster (default 300 s)."""
    yield from _own_cluster(tmp_path_factory, "slow-slurmd", nodes=4, slurmd_timeout_s=120)


@pytest.fixture
def five_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """5 nodes (the worker's has 4): a 2 + 1-spare job, and room for its requeue on three other
    nodes while the fenced one is back in service."""
    yield from _own_cluster(tmp_path_factory, "five", nodes=5)
