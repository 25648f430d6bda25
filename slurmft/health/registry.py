"""Which checks exist, what facts each reads, which run in ``--quick``/deep mode, and their config.

Built-in checks are named ``<area>_<thing>``; external checks ``external_<name>``. ``[sweep]
checks`` picks a subset (empty: all); an unknown name is a ConfigError listing the valid ones.
The config tables are ``[health_gpu]``, ``[health_xid]``, ``[health_dcgm]``, ``[health_node]`` and
``[health_external]``, each a frozen dataclass loaded with ``slurmft.config.load_section``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from slurmft.config import ConfigError, load_section
from slurmft.health import dcgm, gpu_checks, node, xid
from slurmft.health.dcgm import DcgmConfig
from slurmft.health.external import ExternalCheck, ExternalConfig, check_external, run_external
from slurmft.health.facts import FactFailed, Facts, SkipCheck, gather
from slurmft.health.gpu import gather_gpus
from slurmft.health.gpu_checks import GpuConfig
from slurmft.health.node import NodeConfig
from slurmft.health.result import CheckResult
from slurmft.health.state import HealthState
from slurmft.health.xid import XidConfig

Mode = Literal["quick", "normal", "deep"]


@dataclass(frozen=True)
class HealthConfig:
    gpu: GpuConfig = GpuConfig()
    xid: XidConfig = XidConfig()
    dcgm: DcgmConfig = DcgmConfig()
    node: NodeConfig = NodeConfig()
    external: ExternalConfig = ExternalConfig()


def load_health_config(config_file: str | os.PathLike[str] | None = None,
                       environ: Mapping[str, str] | None = None) -> HealthConfig:
    kw: dict[str, Any] = {"config_file": config_file, "environ": environ}
    return HealthConfig(
        gpu=load_section(GpuConfig, "health_gpu", **kw),
        xid=load_section(XidConfig, "health_xid", **kw),
        dcgm=load_section(DcgmConfig, "health_dcgm", **kw),
        node=load_section(NodeConfig, "health_node", **kw),
        external=load_section(ExternalConfig, "health_external", **kw),
    )


@dataclass(frozen=True)
class CheckSpec:
    name: str
    area: Literal["gpu", "xid", "dcgm", "node"]
    fn: Callable[[Facts, Any, HealthState], CheckResult]
    fact: str
    quick: bool
    deep_only: bool = False


BUILTIN: dict[str, CheckSpec] = {s.name: s for s in (
    CheckSpec("gpu_count", "gpu", gpu_checks.check_gpu_count, gpu_checks.GPU_FACT, quick=True),
    CheckSpec("gpu_ecc", "gpu", gpu_checks.check_gpu_ecc, gpu_checks.GPU_FACT, quick=True),
    CheckSpec("gpu_memory_remap", "gpu", gpu_checks.check_gpu_memory_remap, gpu_checks.GPU_FACT, quick=True),
    CheckSpec("gpu_recovery_action", "gpu", gpu_checks.check_gpu_recovery_action, gpu_checks.GPU_FACT, quick=True),
    CheckSpec("gpu_temperature", "gpu", gpu_checks.check_gpu_temperature, gpu_checks.GPU_FACT, quick=False),
    CheckSpec("gpu_throttle", "gpu", gpu_checks.check_gpu_throttle, gpu_checks.GPU_FACT, quick=False),
    CheckSpec("gpu_pcie", "gpu", gpu_checks.check_gpu_pcie, gpu_checks.GPU_FACT, quick=False),
    CheckSpec("gpu_nvlink", "gpu", gpu_checks.check_gpu_nvlink, gpu_checks.GPU_FACT, quick=False),
    CheckSpec("gpu_xid", "xid", xid.check_gpu_xid, xid.XID_FACT, quick=True),
    CheckSpec("dcgm_health", "dcgm", dcgm.check_dcgm_health, dcgm.HEALTH_FACT, quick=True),
    CheckSpec("dcgm_diag", "dcgm", dcgm.check_dcgm_diag, dcgm.DIAG_FACT, quick=False, deep_only=True),
    CheckSpec("node_disk", "node", node.check_node_disk, node.DISK_FACT, quick=True),
    CheckSpec("node_mounts", "node", node.check_node_mounts, node.MOUNT_FACT, quick=True),
    CheckSpec("node_ib", "node", node.check_node_ib, node.IB_FACT, quick=True),
    CheckSpec("node_memory", "node", node.check_node_memory, node.MEM_FACT, quick=True),
)}


def valid_names(hc: HealthConfig) -> list[str]:
    return sorted(BUILTIN) + sorted(c.check_name for c in hc.external.commands)


@dataclass(frozen=True)
class Plan:
    """The checks one sweep runs and the gatherers their facts need."""

    builtin: tuple[CheckSpec, ...]
    external: tuple[ExternalCheck, ...]


def plan(names: tuple[str, ...], hc: HealthConfig, mode: Mode) -> Plan:
    """Resolve ``[sweep] checks`` (empty = all) for ``mode``; unknown names are a ConfigError."""
    valid = valid_names(hc)
    for i, n in enumerate(names):
        if n not in valid:
            raise ConfigError(f"[sweep] checks[{i}]: unknown check {n!r}; valid: {', '.join(valid)}")
    chosen = set(names or valid)
    builtin = tuple(s for s in BUILTIN.values() if s.name in chosen
                    and (mode == "deep" or not s.deep_only) and (mode != "quick" or s.quick))
    external = tuple(c for c in hc.external.commands if c.check_name in chosen
                     and (mode != "quick" or c.quick))
    return Plan(builtin, external)


def gather_timeout(p: Plan, hc: HealthConfig, fact_timeout_s: float) -> float:
    """How long the sweep waits for its facts: ``fact_timeout_s``, stretched in deep mode to
    let ``dcgmi diag`` finish (deep mode is for drained nodes, never for HealthCheckProgram)."""
    if any(s.fact == dcgm.DIAG_FACT for s in p.builtin):
        return max(fact_timeout_s, hc.dcgm.diag_timeout_s + 5.0)
    return fact_timeout_s


def check_timeouts(p: Plan, hc: HealthConfig, fact_timeout_s: float) -> None:
    """Every program a sweep runs must time out (and be killed) before the sweep stops waiting
    for it, or it would outlive the sweep; a config that breaks this is rejected up front."""
    limit = gather_timeout(p, hc, fact_timeout_s)
    programs = [(f"[health_external] commands {c.name!r} timeout_s", c.timeout_s) for c in p.external]
    if any(s.fact == dcgm.HEALTH_FACT for s in p.builtin):
        programs.append(("[health_dcgm] timeout_s", hc.dcgm.timeout_s))
    for where, value in programs:
        if value >= limit:
            raise ConfigError(f"{where} = {value:g} must be below [sweep] fact_timeout_s = {limit:g}")


def gatherers(p: Plan, hc: HealthConfig, state: HealthState, nvml: Any = None) -> dict[str, Callable[[], Any]]:
    sources: dict[str, Callable[[], Any]] = {
        gpu_checks.GPU_FACT: lambda: gather_gpus(nvml),
        xid.XID_FACT: lambda: xid.gather_xids(hc.xid, state),
        dcgm.HEALTH_FACT: lambda: dcgm.run_dcgmi(hc.dcgm.health_argv, hc.dcgm.timeout_s),
        dcgm.DIAG_FACT: lambda: dcgm.run_dcgmi(hc.dcgm.diag_argv, hc.dcgm.diag_timeout_s),
        node.DISK_FACT: lambda: node.gather_disk(hc.node.disk_paths),
        node.MOUNT_FACT: node.gather_mounts,
        node.IB_FACT: lambda: node.gather_ib(hc.node.ib_sysfs),
        node.MEM_FACT: node.gather_memory,
    }
    wanted = {s.fact: sources[s.fact] for s in p.builtin}
    for c in p.external:
        wanted[c.check_name] = functools.partial(run_external, c)
    return wanted


def run_guarded(name: str, fn: Callable[[], CheckResult]) -> CheckResult:
    try:
        return fn()
    except SkipCheck as exc:
        return CheckResult.skipped(name, str(exc))
    except FactFailed as exc:
        return CheckResult.fail(name, str(exc))
    except Exception as exc:  # noqa: BLE001 - a broken check is reported, never silently passed
        return CheckResult.fail(name, f"check crashed: {type(exc).__name__}: {exc}")


def run_plan(p: Plan, hc: HealthConfig, state: HealthState, timeout_s: float,
             nvml: Any = None) -> tuple[list[CheckResult], Facts]:
    """Gather every needed fact once (bounded by ``gather_timeout``), then run each check."""
    facts = gather(gatherers(p, hc, state, nvml), gather_timeout(p, hc, timeout_s))
    configs = {"gpu": hc.gpu, "xid": hc.xid, "dcgm": hc.dcgm, "node": hc.node}

    def bound(s: CheckSpec) -> Callable[[], CheckResult]:
        return lambda: s.fn(facts, configs[s.area], state)

    results = [run_guarded(s.name, bound(s)) for s in p.builtin]
    results += [run_guarded(c.check_name, functools.partial(check_external, c, facts)) for c in p.external]
    return results, facts
