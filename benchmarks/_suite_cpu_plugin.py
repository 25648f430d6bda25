"""pytest plugin of ``benchmarks/suite_cpu.py``: each test's CPU-seconds, through a cgroup of the
worker's own.

At ``pytest_configure`` the process (an xdist worker, or pytest itself without xdist) moves into
``$SLURMFT_SUITE_CPU_CGROUP/<worker>``; everything it starts afterwards is born there: the
devcluster's daemons, the jobs they run, the ranks (the devcluster's ``proctrack/linuxproc``
moves nothing). Around each test (setup, call, teardown) it reads the cgroup's CPU counter and
appends one JSON line to ``$SLURMFT_SUITE_CPU_OUT``. A test is charged with whatever its worker's
tree spent meanwhile, the daemons' idle ticks too: each worker runs one test at a time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

CGROUP_ENV = "SLURMFT_SUITE_CPU_CGROUP"
KIND_ENV = "SLURMFT_SUITE_CPU_KIND"   # "v2" (cpu.stat) or "v1" (cpuacct.usage)
OUT_ENV = "SLURMFT_SUITE_CPU_OUT"
PYTHONPATH_ENV = "SLURMFT_SUITE_CPU_PYTHONPATH"   # the suite's own PYTHONPATH, without this directory


def usage_s(cgroup: Path, kind: str) -> float:
    """CPU-seconds spent so far by every process that ever ran in ``cgroup``."""
    if kind == "v1":
        return int((cgroup / "cpuacct.usage").read_text()) / 1e9
    for line in (cgroup / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    raise RuntimeError(f"{cgroup}/cpu.stat has no usage_usec")


class _Meter:
    def __init__(self, cgroup: Path, kind: str, out: Path, worker: str) -> None:
        self.cgroup, self.kind, self.out, self.worker = cgroup, kind, out, worker
        self.outcomes: dict[str, str] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        cpu0, wall0 = usage_s(self.cgroup, self.kind), time.monotonic()
        yield
        cpu1, wall1 = usage_s(self.cgroup, self.kind), time.monotonic()
        record = {"id": item.nodeid, "cpu_s": round(cpu1 - cpu0, 3), "wall_s": round(wall1 - wall0, 3),
                  "worker": self.worker, "outcome": self.outcomes.pop(item.nodeid, "passed")}
        with open(self.out, "a") as fh:   # one short line per write: the workers' lines never mix
            fh.write(json.dumps(record) + "\n")

    def pytest_runtest_logreport(self, report):
        if report.outcome != "passed" and report.nodeid not in self.outcomes:
            self.outcomes[report.nodeid] = f"{report.when} {report.outcome}"


def pytest_configure(config):
    top, kind, out = (os.environ.get(name) for name in (CGROUP_ENV, KIND_ENV, OUT_ENV))
    if not (top and kind and out):
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None and config.getoption("dist", "no") != "no":
        return   # the xdist controller runs no test: its workers are measured
    worker = worker or "main"
    # What the tests start (clusters, jobs, ranks) sees the suite's environment, not the benchmark's.
    for name in (CGROUP_ENV, KIND_ENV, OUT_ENV):
        os.environ.pop(name, None)
    saved = os.environ.pop(PYTHONPATH_ENV, None)
    if saved is not None:
        if saved:
            os.environ["PYTHONPATH"] = saved
        else:
            os.environ.pop("PYTHONPATH", None)
    cgroup = Path(top) / worker
    cgroup.mkdir(exist_ok=True)
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    config.pluginmanager.register(_Meter(cgroup, kind, Path(out), worker), "slurmft_suite_cpu_meter")
