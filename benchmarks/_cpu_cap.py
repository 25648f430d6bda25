"""Cap this process, and every process it starts afterwards, at a share of the CPUs.

A cgroup's CPU quota (cgroup v2 ``cpu.max``, or v1's ``cpu`` controller): a benchmark's devcluster
started under it runs as on a loaded node, the same load every time. This is how the 01:05 soak's
slow spare activations (75 and 89 s) were reproduced at will (``benchmarks/soak.py --cpu-cap``,
docs/performance.md). Root only. ``release`` moves this process back to the cgroup it came from
(what it starts afterwards runs uncapped); ``remove`` deletes the group once nothing is left in it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CapError(RuntimeError):
    """The cap cannot be set (the message is one line naming what is wrong)."""


@dataclass
class Cap:
    path: Path          # the group
    home: Path          # the cgroup.procs of the group this process came from

    def release(self) -> None:
        self.home.write_text(str(os.getpid()))

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:   # still in use (a process the benchmark could not stop): left for root
            pass


def _own_group(root: Path, v2: bool, proc_cgroup: Path) -> Path:
    """This process's group directory under ``root`` (from /proc/self/cgroup)."""
    for line in proc_cgroup.read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if (v2 and controllers == "") or (not v2 and "cpu" in controllers.split(",")):
            return root / rel.lstrip("/")
    return root


def check(cpus: float, root: Path = ROOT) -> tuple[bool, Path]:
    """(cgroup v2?, the cpu hierarchy) when ``cpus`` can be a cap here; CapError if not."""
    ncpu = os.cpu_count() or 1
    if not 0 < cpus <= ncpu:
        raise CapError(f"--cpu-cap {cpus}: must be more than 0 and at most {ncpu} (this "
                       "machine's CPUs)")
    v2 = (root / "cgroup.controllers").exists()
    hierarchy = root if v2 else root / "cpu"
    if not v2 and not (hierarchy / "cpu.cfs_quota_us").exists():
        raise CapError(f"--cpu-cap: no cgroup cpu controller under {root}")
    if os.geteuid() != 0:
        raise CapError("--cpu-cap: only root can create a cgroup")
    return v2, hierarchy


def cap_self(cpus: float, name: str, root: Path = ROOT,
             proc_cgroup: Path = Path("/proc/self/cgroup")) -> Cap:
    """Move this process into a new group ``name`` allowed ``cpus`` CPUs (e.g. 0.2)."""
    v2, hierarchy = check(cpus, root)
    quota = max(1000, int(cpus * PERIOD_US))
    path = hierarchy / name
    try:
        home = _own_group(hierarchy, v2, proc_cgroup) / "cgroup.procs"
        path.mkdir()
        if v2:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        (path / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        Cap(path, root).remove()
        raise CapError(f"cannot cap the CPU at {path}: {exc.strerror} (root only; on cgroup v2 "
                       "the cpu controller must be enabled in the parent)") from None
    return Cap(path, home)
