"""GPU facts from NVML (nvidia-ml-py, ``import pynvml``), read once per sweep.

``gather_gpus(nvml)`` turns NVML into plain frozen dataclasses (``GpuDevice``); the checks in
``gpu_checks.py`` only read those. ``nvml`` is the ``pynvml`` module, or any object with the same
functions and constants (tests drive one from real ``nvidia-smi -q`` outputs).

Every per-device query that the GPU or driver does not support is recorded as ``None`` ("not
reported"), never as zero: a consumer GPU without ECC has no ECC count, not a clean one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from slurmft.health.facts import Unavailable

# Throttle/"clocks event" reason bits, named as nvidia-smi -q prints them.
THROTTLE_BITS = {
    "hw_slowdown": "nvmlClocksThrottleReasonHwSlowdown",
    "hw_thermal": "nvmlClocksThrottleReasonHwThermalSlowdown",
    "hw_power_brake": "nvmlClocksThrottleReasonHwPowerBrakeSlowdown",
    "sw_thermal": "nvmlClocksThrottleReasonSwThermalSlowdown",
}

# NVML's GPU recovery action values (NVML_GPU_RECOVERY_ACTION_*), 0-4 as Xid 154 prints them;
# 5-7 are newer NVML constants (nvidia-ml-py 13: RECOVER_IMEX_DOMAIN, BUS_RESET, SYSTEM_REBOOT),
# named after them. Any value but 0 drains (gpu_checks.check_gpu_recovery_action).
RECOVERY_ACTIONS = {0: "None", 1: "GPU Reset Required", 2: "Node Reboot Required",
                    3: "Drain P2P", 4: "Drain and Reset", 5: "Recover IMEX Domain",
                    6: "Bus Reset", 7: "System Reboot"}

NVLINK_COUNTERS = {
    "replay": "NVML_NVLINK_ERROR_DL_REPLAY",
    "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
    "crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA",
}


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    bus_id: str
    ecc_dbe_volatile: int | None = None
    retired_pages_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    remap_uncorrectable: int | None = None
    temperature_c: int | None = None
    slowdown_c: int | None = None
    shutdown_c: int | None = None
    throttle: frozenset[str] | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    # link number -> {"replay": n, ...}; only links NVML reports active
    nvlink_errors: dict[int, dict[str, int]] = field(default_factory=dict)
    nvlink_active: int | None = None
    recovery_action: int | None = None

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.bus_id})"


@dataclass(frozen=True)
class GpuFacts:
    driver: str
    devices: tuple[GpuDevice, ...]


def _short_bus_id(raw: Any) -> str:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    # NVML: "00000000:3B:00.0"; kernel logs and humans: "0000:3b:00.0"
    if len(text) > 12 and text.count(":") == 2:
        text = text[4:]
    return text.lower()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _query(nvml: Any, fn: Callable[[], Any]) -> Any:
    """Call ``fn``; NOT_SUPPORTED / N/A from NVML means "not reported" (None)."""
    try:
        return fn()
    except nvml.NVMLError:
        return None


def _device(nvml: Any, index: int) -> GpuDevice:
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    q = lambda fn: _query(nvml, fn)  # noqa: E731

    remap = q(lambda: nvml.nvmlDeviceGetRemappedRows(h))
    reasons = q(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))
    throttle = None
    if reasons is not None:
        throttle = frozenset(n for n, c in THROTTLE_BITS.items() if reasons & getattr(nvml, c))
    pending = q(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(h))

    return GpuDevice(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(h)),
        bus_id=_short_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId),
        ecc_dbe_volatile=q(lambda: nvml.nvmlDeviceGetTotalEccErrors(
            h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)),
        retired_pages_pending=None if pending is None else bool(pending),
        remap_uncorrectable=None if remap is None else int(remap[1]),
        remap_pending=None if remap is None else bool(remap[2]),
        remap_failed=None if remap is None else bool(remap[3]),
        temperature_c=q(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
        slowdown_c=q(lambda: nvml.nvmlDeviceGetTemperatureThreshold(
            h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
        shutdown_c=q(lambda: nvml.nvmlDeviceGetTemperatureThreshold(
            h, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)),
        throttle=throttle,
        pcie_width=q(lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
        pcie_width_max=q(lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(h)),
        pcie_gen=q(lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
        pcie_gen_max=q(lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
        **_nvlinks(nvml, h),
        recovery_action=_recovery_action(nvml, h),
    )


def _nvlinks(nvml: Any, h: Any) -> dict[str, Any]:
    errors: dict[int, dict[str, int]] = {}
    active = 0
    supported = False
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0)):
        state = _query(nvml, lambda: nvml.nvmlDeviceGetNvLinkState(h, link))
        if state is None:
            continue
        supported = True
        if state != nvml.NVML_FEATURE_ENABLED:
            continue
        active += 1
        counts = {}
        for name, const in NVLINK_COUNTERS.items():
            value = _query(nvml, lambda: nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, getattr(nvml, const)))
            if value is not None:
                counts[name] = int(value)
        errors[link] = counts
    return {"nvlink_errors": errors, "nvlink_active": active if supported else None}


def _recovery_action(nvml: Any, h: Any) -> int | None:
    """NVML's recovery-action field (drivers 570+); None where the constant or driver lacks it."""
    fid = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if fid is None:
        return None
    values = _query(nvml, lambda: nvml.nvmlDeviceGetFieldValues(h, [fid]))
    if not values or values[0].nvmlReturn != nvml.NVML_SUCCESS:
        return None
    return int(values[0].value.uiVal)


def gather_gpus(nvml: Any = None) -> GpuFacts | Unavailable:
    """Read every GPU through NVML (``nvml``: the pynvml module or a stand-in; None: import it);
    ``Unavailable`` when NVML (the driver library) is absent."""
    if nvml is None:
        try:
            import pynvml  # nvidia-ml-py; a core dependency, torch-free
        except ImportError as exc:
            return Unavailable(f"nvidia-ml-py not installed ({exc})")
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return Unavailable(f"NVML not available: {exc}")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        count = nvml.nvmlDeviceGetCount()
        return GpuFacts(driver, tuple(_device(nvml, i) for i in range(count)))
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
