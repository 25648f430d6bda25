"""Integration tests (real Slurm devclusters) and the rules they follow under xdist.

``make test`` runs the suite in parallel workers (``pytest -n N --dist loadgroup``, in a random
order). Each worker is its own pytest session with its own 4-node devcluster (tests/conftest.py),
and runs one test at a time. A new integration test follows these rules:

1. **Use the fixtures.** ``slurm_cluster`` is the worker's cluster, reset before the test (no
   job, every node IDLE, every daemon alive): on it a test may kill nodes, restart the
   controller, drain, ``set_down``: the next test gets it reset. Anything ``reset()`` does not
   undo (``slurm.conf`` edits and ``scontrol reconfigure``, a MinJobAge, accounting changes)
   needs a cluster of the test's own: ``forgetful_cluster``, or ``DevCluster.up`` in
   ``tmp_path`` taken down in a ``finally`` (a module-scoped one is fine: see 4).
2. **Nothing shared across workers.** No fixed port (let the kernel pick: bind port 0, or the
   launcher's pre-flight), no fixed path (``tmp_path``, or ``tempfile.mkdtemp`` for a directory
   other users must reach), no fixed user name (add the pid), no fixed cluster or node name
   outside your cluster's. A check over the whole machine (processes, /etc/hosts, users) filters
   by what the test owns: its cluster's name or directory, its own pids; another worker's
   cluster is running beside it. (What is shared on purpose: a reference run's losses,
   deterministic and read-only, through ``reference_cache`` in the run's own temp dir.)
3. **No order.** The order is random (pytest-randomly prints its seed): a test sets up
   everything it needs and leaves its worker's cluster for ``reset()`` to clean. A test that
   passes alone and fails after another is a bug in one of the two.
4. **A module-scoped world** (a fixture of the module's own with ``scope="module"``) puts the
   module's tests that use it into one xdist group (tests/conftest.py does it): one worker
   builds it once. Mark ``@pytest.mark.xdist_group("name")`` by hand for any other sharing.
5. **Bounds, not budgets.** Every wait is bounded, with a message naming what it waited for, and
   generously: the suite runs on a loaded 2-core box with other tests' jobs beside yours. A
   bound says "it happened at all", never "it was fast": a time figure belongs in
   ``benchmarks/`` (or is printed). Give a long test ``@pytest.mark.timeout(S)``: the scheduler
   starts the tests with the largest bounds first.
6. **Clean up what you start** outside the fixtures (a watcher started by ``TrainJob.watch`` is
   stopped after the test, pass or fail, by the fixture below).
7. **Imports.** Test modules are imported by path (``--import-mode=importlib``): a basename may
   repeat in tests/unit; a helper module imported by name (``train_job_support``,
   ``watch_support``) lives in a directory listed in pyproject.toml's ``pythonpath``.
"""

import pytest

from train_job_support import stop_watchers


@pytest.fixture(autouse=True)
def _stop_watchers():
    yield
    stop_watchers()
