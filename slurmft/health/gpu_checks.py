"""GPU checks: pure functions of the NVML facts (``gpu.GpuFacts``) and ``GpuConfig``.

Each ``check_gpu_<thing>(facts, cfg, state)`` returns one ``CheckResult`` that sums up every GPU;
its detail names the GPUs at fault and is the drain reason. Thresholds come from ``[health_gpu]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slurmft.health.facts import Facts, SkipCheck
from slurmft.health.gpu import RECOVERY_ACTIONS, THROTTLE_BITS, GpuFacts
from slurmft.health.result import CheckResult, findings
from slurmft.health.state import HealthState
from slurmft.health.state_check import GPUS_SEEN, NVLINK

GPU_FACT = "gpu"
Level = Literal["ignore", "warn", "fail"]


@dataclass(frozen=True)
class GpuConfig:
    """``[health_gpu]``: what a healthy GPU node looks like."""

    expected_count: int = 0  # 0: do not check the count (but a node with NVML and 0 GPUs warns)
    temp_warn_margin_c: int = 5  # warn this close to the GPU's own slowdown threshold
    temp_fail_c: int = 0  # absolute fail threshold; 0: the GPU's slowdown threshold
    throttle_fail: tuple[str, ...] = ("hw_thermal",)
    throttle_warn: tuple[str, ...] = ("hw_slowdown", "hw_power_brake", "sw_thermal")
    pcie_gen_below_max: Level = "ignore"  # idle GPUs drop to Gen1 to save power: not a fault
    nvlink_error_rise_max: int = 0  # summed DL errors per GPU between two sweeps above this fails
    nvlink_expected_active: int = 0  # per GPU; 0: do not check

    def __post_init__(self) -> None:
        for name in ("expected_count", "temp_warn_margin_c", "temp_fail_c", "nvlink_error_rise_max",
                     "nvlink_expected_active"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("throttle_fail", "throttle_warn"):
            for reason in getattr(self, name):
                if reason not in THROTTLE_BITS:
                    raise ValueError(f"{name}: unknown throttle reason {reason!r}; "
                                     f"valid: {', '.join(THROTTLE_BITS)}")


def _gpus(facts: Facts) -> GpuFacts:
    value: GpuFacts = facts.need(GPU_FACT)
    return value


def check_gpu_count(facts: Facts, cfg: GpuConfig, state: HealthState) -> CheckResult:
    name = "gpu_count"
    try:
        gpus = _gpus(facts)
    except SkipCheck as exc:
        if cfg.expected_count:
            return CheckResult.fail(name, f"expected {cfg.expected_count} GPUs, found none: {exc}")
        raise
    n = len(gpus.devices)
    if cfg.expected_count and n != cfg.expected_count:
        return CheckResult.fail(name, f"expected {cfg.expected_count} GPUs, NVML sees {n}")
    if n == 0:
        return CheckResult.warn(name, "NVML loaded but sees no GPU")
    return CheckResult.ok(name, f"{n} GPUs, driver {gpus.driver}")




def _unproven(gpus: GpuFacts, state: HealthState, unread: list[str], what: str) -> None:
    """Raise SkipCheck when a clean result would not be proof: no GPU, a GPU an earlier sweep saw
    has gone (a GPU that fell off the bus takes its error counters with it), or a counter could not
    be read. A skipped check never drains, and keeps a drain it is behind (fail closed)."""
    seen = state.get(GPUS_SEEN) or []
    present = {d.bus_id for d in gpus.devices}
    gone = sorted(b for b in seen if isinstance(b, str) and b not in present)
    if not gone:
        state.set(GPUS_SEEN, sorted(present))
    if not gpus.devices:
        raise SkipCheck(f"NVML sees no GPU: no {what} to read")
    if gone:
        raise SkipCheck(f"GPU(s) {', '.join(gone)} seen by an earlier sweep are gone: their {what} "
                        f"cannot be read (if a GPU was removed on purpose, delete the sweep state)")
    if unread:
        raise SkipCheck(f"{what} unreadable on {', '.join(unread)}")


def check_gpu_ecc(facts: Facts, cfg: GpuConfig, state: HealthState) -> CheckResult:
    """Volatile double-bit ECC errors; ECC that cannot be read (no ECC, NVML error) is no proof."""
    gpus = _gpus(facts)
    bad = [f"{d.label}: {d.ecc_dbe_volatile} volatile double-bit ECC errors"
           for d in gpus.devices if d.ecc_dbe_volatile]
    if not bad:
        _unproven(gpus, state, [d.label for d in gpus.devices if d.ecc_dbe_volatile is None],
                  "ECC error counters")
    return findings("gpu_ecc", bad, [], "no volatile double-bit ECC errors")


def check_gpu_memory_remap(facts: Facts, cfg: GpuConfig, state: HealthState) -> CheckResult:
    """Row remapping (Ampere+) failed or pending, or page retirement (Volta and older) pending.
    A GPU that reports neither is no proof (skipped, unless another GPU fails)."""
    fail, warn = [], []
    gpus = _gpus(facts)
    unread = [d.label for d in gpus.devices
              if d.remap_failed is None and d.remap_pending is None and d.retired_pages_pending is None]
    for d in gpus.devices:
        if d.remap_failed:
            fail.append(f"{d.label}: row remapping failed")
        elif d.remap_pending and d.remap_uncorrectable:
            fail.append(f"{d.label}: {d.remap_uncorrectable} uncorrectable-error row remaps "
                        "pending, GPU reset required")
        elif d.remap_pending:
            warn.append(f"{d.label}: correctable-error row remap pending (reset at next idle)")
        if d.retired_pages_pending:
            fail.append(f"{d.label}: retired pages pending, GPU reset required")
    if not fail:
        _unproven(gpus, state, unread, "row-remap/page-retirement status")
    return findings("gpu_memory_remap", fail, warn, "no pending or failed row remaps/page retirements")


def check_gpu_temperature(facts: Facts, cfg: GpuConfig, state: HealthState) -> CheckResult:
    fail, warn = [], []
    for d in _gpus(facts).devices:
        if d.temperature_c is None:
            continue
        limit = cfg.temp_fail_c or d.slowdown_c
        if limit is None:
            continue
        if d.temperature_c >= limit:
            fail.append(f"{d.label}: {d.temperature_c} C >= {limit} C")
        elif d.temperature_c >= limit - cfg.temp_warn_margin_c:
            warn.append(f"{d.label}: {d.temperature_c} C within {cfg.temp_warn_margin_c} C of {limit} C")
    return findings("gpu_temperature", fail, warn, "temperatures below thresholds")


def check_gpu_throttle(facts: Facts, cfg: GpuConfig, state: HealthState) -> CheckResult:
    fail, warn = [], []
    for d in _gpus(facts).devices:
        active = d.throttle or frozenset()
        hard = sorted(active & set(cfg.throttle_fail))
        soft = sorted(active & set(cfg.throttle_warn))
        if hard:
            fail.append(f"{d.label}: clocks throttled ({', '.join(hard)})")
        elif soft:
            warn.append(f"{d.label}: clocks throttled ({', '.join(soft)})")
    return findings("gpu_throttle", fail, warn, "no hardware/thermal clock slowdown")


def check_gpu_pcie(facts: Facts, cfg: GpuConfig, state: HealthState) -> CheckResult:
    """Link width below the device max is a degraded link; gen below max is idle power saving."""
    fail, gen_low = [], []
    for d in _gpus(facts).devices:
        if d.pcie_width is not None and d.pcie_width_max and d.pcie_width < d.pcie_width_max:
            fail.append(f"{d.label}: PCIe link x{d.pcie_width} below device max x{d.pcie_width_max}")
        if d.pcie_gen is not None and d.pcie_gen_max and d.pcie_gen < d.pcie_gen_max:
            gen_low.append(f"{d.label}: PCIe Gen{d.pcie_gen} below max Gen{d.pcie_gen_max}")
    if cfg.pcie_gen_below_max == "fail":
        fail += gen_low
    warn = gen_low if cfg.pcie_gen_below_max == "warn" else []
    return findings("gpu_pcie", fail, warn, "PCIe links at full width")


def check_gpu_nvlink(facts: Facts, cfg: GpuConfig, state: HealthState) -> CheckResult:
    """Active link count, and DL error counters rising since the previous sweep (kept in state)."""
    gpus = _gpus(facts)
    previous = state.get(NVLINK, {})
    current: dict[str, dict[str, dict[str, int]]] = {}
    fail: list[str] = []
    seen_any = False
    for d in gpus.devices:
        if d.nvlink_active is None:
            continue
        seen_any = True
        if cfg.nvlink_expected_active and d.nvlink_active < cfg.nvlink_expected_active:
            fail.append(f"{d.label}: {d.nvlink_active} NVLinks active, expected {cfg.nvlink_expected_active}")
        links = {str(link): counts for link, counts in d.nvlink_errors.items()}
        current[d.bus_id] = links
        before = previous.get(d.bus_id, {})
        rise = sum(max(0, n - before.get(link, {}).get(kind, n))
                   for link, counts in links.items() for kind, n in counts.items())
        if rise > cfg.nvlink_error_rise_max:
            fail.append(f"{d.label}: NVLink errors rose by {rise} since the last sweep")
    state.set(NVLINK, current)
    if not seen_any:
        raise SkipCheck("no NVLink on this node")
    return findings("gpu_nvlink", fail, [], "NVLinks up, error counters steady")


def check_gpu_recovery_action(facts: Facts, cfg: GpuConfig, state: HealthState) -> CheckResult:
    """NVML's recovery-action field: anything but None drains (Xid 154's verdict, read directly)."""
    gpus = _gpus(facts)
    reported = [(d, d.recovery_action) for d in gpus.devices if d.recovery_action is not None]
    if not reported:
        raise SkipCheck(f"driver {gpus.driver} does not report a GPU recovery action")
    bad = [f"{d.label}: recovery action {RECOVERY_ACTIONS.get(action, action)}"
           for d, action in reported if action != 0]
    return findings("gpu_recovery_action", bad, [], "no recovery action pending")
