"""Node checks: free space on the checkpoint/scratch paths, required mounts, InfiniBand ports,
free memory. Facts come from statvfs, ``/proc/self/mountinfo``, ``/sys/class/infiniband`` and
``/proc/meminfo``; the roots are parameters so tests can point them at a copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from slurmft.health.facts import Facts, SkipCheck, Unavailable
from slurmft.health.result import CheckResult, findings
from slurmft.health.state import HealthState
from slurmft.health.state_check import IB_LINK_DOWNED

DISK_FACT, MOUNT_FACT, IB_FACT, MEM_FACT = "disk", "mounts", "ib", "memory"
GIB = 1024 ** 3


@dataclass(frozen=True)
class NodeConfig:
    """``[health_node]``: paths that must have room, mounts that must be there, IB and memory."""

    disk_paths: tuple[Path, ...] = ()
    disk_min_free_gib: float = 10.0
    disk_min_free_percent: float = 5.0
    required_mounts: tuple[Path, ...] = ()
    ib_required: bool = False  # a node without /sys/class/infiniband fails instead of skipping
    ib_sysfs: Path = Path("/sys/class/infiniband")
    memory_min_available_gib: float = 1.0

    def __post_init__(self) -> None:
        for i, p in enumerate(self.disk_paths):
            if not Path(p).exists():
                raise ValueError(f"disk_paths[{i}]: {p} does not exist")
        for name in ("disk_min_free_gib", "disk_min_free_percent", "memory_min_available_gib"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True)
class DiskSpace:
    path: str
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class IbPort:
    device: str
    port: str
    state: str  # "ACTIVE", "DOWN", "INIT"...
    link_downed: int | None


def gather_disk(paths: tuple[Path, ...]) -> tuple[DiskSpace, ...]:
    out = []
    for p in paths:
        st = os.statvfs(p)
        out.append(DiskSpace(str(p), st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize))
    return tuple(out)


def gather_mounts(mountinfo: Path = Path("/proc/self/mountinfo")) -> frozenset[str]:
    """Mount points, octal escapes (``\\040`` for a space) decoded."""
    points = set()
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.add(fields[4].encode().decode("unicode_escape"))
    return frozenset(points)


def gather_ib(sysfs: Path) -> tuple[IbPort, ...] | Unavailable:
    if not sysfs.is_dir():
        return Unavailable(f"no InfiniBand ({sysfs} absent)")
    ports = []
    for dev in sorted(sysfs.iterdir()):
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else ():
            raw = (port / "state").read_text().strip()  # "4: ACTIVE"
            state = raw.split(":", 1)[-1].strip()
            counter = port / "counters" / "link_downed"
            downed = int(counter.read_text().strip()) if counter.is_file() else None
            ports.append(IbPort(dev.name, port.name, state, downed))
    return tuple(ports)


def gather_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemAvailable line")


def check_node_disk(facts: Facts, cfg: NodeConfig, state: HealthState) -> CheckResult:
    disks: tuple[DiskSpace, ...] = facts.need(DISK_FACT)
    if not disks:
        raise SkipCheck("no disk_paths configured")
    bad = []
    for d in disks:
        pct = 100.0 * d.free_bytes / d.total_bytes if d.total_bytes else 0.0
        gib = d.free_bytes / GIB
        if gib < cfg.disk_min_free_gib or pct < cfg.disk_min_free_percent:
            bad.append(f"{d.path}: {gib:.1f} GiB free ({pct:.1f}%), need {cfg.disk_min_free_gib:g} GiB "
                       f"and {cfg.disk_min_free_percent:g}%")
    return findings("node_disk", bad, [], f"{len(disks)} paths have room")


def check_node_mounts(facts: Facts, cfg: NodeConfig, state: HealthState) -> CheckResult:
    if not cfg.required_mounts:
        raise SkipCheck("no required_mounts configured")
    mounted: frozenset[str] = facts.need(MOUNT_FACT)
    missing = [m for m in (str(p).rstrip("/") or "/" for p in cfg.required_mounts) if m not in mounted]
    return findings("node_mounts", [f"{m} not mounted" for m in missing], [],
                    f"{len(cfg.required_mounts)} required mounts present")


def check_node_ib(facts: Facts, cfg: NodeConfig, state: HealthState) -> CheckResult:
    name = "node_ib"
    value = facts.raw(IB_FACT)
    if isinstance(value, Unavailable) and cfg.ib_required:
        return CheckResult.fail(name, value.reason)
    ports: tuple[IbPort, ...] = facts.need(IB_FACT)
    previous = state.get(IB_LINK_DOWNED, {})
    current = {}
    fail = []
    for p in ports:
        key = f"{p.device}/{p.port}"
        if p.state != "ACTIVE":
            fail.append(f"{key} is {p.state}")
        if p.link_downed is not None:
            current[key] = p.link_downed
            before = previous.get(key)
            if before is not None and p.link_downed > before:
                fail.append(f"{key} link_downed rose {before} -> {p.link_downed}")
    state.set(IB_LINK_DOWNED, current)
    if not ports:
        return CheckResult.fail(name, f"{cfg.ib_sysfs} lists no ports") if cfg.ib_required \
            else CheckResult.skipped(name, "no InfiniBand ports")
    return findings(name, fail, [], f"{len(ports)} IB ports ACTIVE")


def check_node_memory(facts: Facts, cfg: NodeConfig, state: HealthState) -> CheckResult:
    available: int = facts.need(MEM_FACT)
    gib = available / GIB
    if gib < cfg.memory_min_available_gib:
        return CheckResult.fail("node_memory", f"{gib:.1f} GiB available, need {cfg.memory_min_available_gib:g} GiB")
    return CheckResult.ok("node_memory", f"{gib:.1f} GiB available")
