"""A pynvml-shaped stand-in whose every value comes from a REAL ``nvidia-smi -q`` output.

There is no GPU on the test machines, so ``gather_gpus`` is driven by this object: it parses a
fixture from ``tests/fixtures/health/nvidia-smi-q/`` (indentation tree) and answers the NVML
calls slurmft makes from the same fields nvidia-smi printed them from. Constants and the error
class are the real ``pynvml`` ones. Fields the output prints as ``N/A`` (or lacks) raise
NVML_ERROR_NOT_SUPPORTED, as NVML does.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pynvml

from slurmft.health.gpu import RECOVERY_ACTIONS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "health" / "nvidia-smi-q"
_GPU_HEADER = re.compile(r"^GPU ([0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_ENTRY = re.compile(r"^(?P<indent> *)(?P<key>[^:]+?)\s*(?::\s*(?P<value>.*?))?\s*$")


def parse_smi(text: str) -> tuple[dict[str, str], list[list[tuple[tuple[str, ...], str, str]]]]:
    """(top-level fields, per GPU a list of (ancestor keys, key, value))."""
    top: dict[str, str] = {}
    gpus: list[list[tuple[tuple[str, ...], str, str]]] = []
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.strip() == "[...]" or line.startswith("="):
            continue
        header = _GPU_HEADER.match(line)
        if header:
            gpus.append([((), "Bus Id", header.group(1))])
            stack = []
            continue
        m = _ENTRY.match(line)
        if not m:
            continue
        indent, key, value = len(m.group("indent")), m.group("key").strip(), m.group("value")
        if indent == 0 and value is not None and not gpus:
            top[key] = value
            continue
        if not gpus:  # FRAGMENT files: one unnamed GPU
            gpus.append([((), "Bus Id", "00000000:00:00.0")])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        gpus[-1].append((tuple(k for _, k in stack), key, value or ""))
        stack.append((indent, key))
    return top, gpus


# nvidia-smi -q's "GPU Recovery Action" values (driver 580: "None" seen on an H200) -> NVML's value.
_RECOVERY_ACTION_TEXT = {text: value for value, text in RECOVERY_ACTIONS.items()}


def _not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


class FakeNvml:
    """Answers slurmft's NVML calls from one parsed ``nvidia-smi -q``."""

    NVMLError = pynvml.NVMLError

    def __init__(self, text: str, hang: str | None = None, overrides: dict | None = None) -> None:
        self._top, self._gpus = parse_smi(text)
        self._hang = hang  # name of a call that never returns (NVML after Xid 119)
        self._overrides = overrides or {}  # (call name, index) -> value
        self.calls = 0

    @classmethod
    def from_fixture(cls, name: str, **kw) -> "FakeNvml":
        return cls((FIXTURES / name).read_text(), **kw)

    def __getattr__(self, name: str):
        if name.startswith(("NVML_", "nvmlClocks")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # -- lookup helpers --------------------------------------------------------------------
    def _field(self, i: int, section: str | None, key: str) -> str:
        for ancestors, k, v in self._gpus[i]:
            if k.lower() == key.lower() and (section is None or section.lower() in (a.lower() for a in ancestors)):
                if v in ("", "N/A"):
                    raise _not_supported()
                return v
        raise _not_supported()

    def _int(self, i: int, section: str | None, key: str) -> int:
        return int(re.match(r"-?\d+", self._field(i, section, key)).group())

    def _call(self, name: str, i: int):
        self.calls += 1
        if name == self._hang:
            threading.Event().wait()  # hangs forever, like a wedged driver call
        if (name, i) in self._overrides:
            return self._overrides[(name, i)]
        return None

    # -- the NVML calls slurmft makes --------------------------------------------------------
    def nvmlInit(self) -> None:
        self._call("nvmlInit", -1)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._top.get("Driver Version", "unknown").split()[0]

    def nvmlDeviceGetCount(self) -> int:
        got = self._call("nvmlDeviceGetCount", -1)
        return got if got is not None else len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, i: int) -> str:
        try:
            return self._field(i, None, "Product Name")
        except pynvml.NVMLError:
            return "unnamed GPU"

    def nvmlDeviceGetPciInfo(self, i: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._field(i, None, "Bus Id"))

    def nvmlDeviceGetTotalEccErrors(self, i: int, kind: int, counter: int) -> int:
        assert kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED and counter == pynvml.NVML_VOLATILE_ECC
        got = self._call("nvmlDeviceGetTotalEccErrors", i)
        if got is not None:
            return got
        total, found = 0, False
        for ancestors, k, v in self._gpus[i]:
            if "Volatile" in ancestors and ("Uncorrectable" in k or (ancestors[-1] == "Double Bit" and k == "Total")):
                if v not in ("", "N/A"):
                    total, found = total + int(v), True
        if not found:
            raise _not_supported()
        return total

    def nvmlDeviceGetRetiredPagesPendingStatus(self, i: int) -> int:
        return 1 if self._field(i, None, "Pending Page Blacklist") == "Yes" else 0

    def nvmlDeviceGetRemappedRows(self, i: int) -> tuple[int, int, int, int]:
        sec = "Remapped Rows"
        return (self._int(i, sec, "Correctable Error"), self._int(i, sec, "Uncorrectable Error"),
                int(self._field(i, sec, "Pending") == "Yes"),
                int(self._field(i, sec, "Remapping Failure Occurred") == "Yes"))

    def nvmlDeviceGetTemperature(self, i: int, sensor: int) -> int:
        return self._int(i, "Temperature", "GPU Current Temp")

    def nvmlDeviceGetTemperatureThreshold(self, i: int, which: int) -> int:
        word = "Slowdown" if which == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN else "Shutdown"
        try:
            return self._int(i, "Temperature", f"GPU {word} Temp")
        except pynvml.NVMLError:
            # Hopper prints margins to T.Limit: limit = current + margin; threshold = limit - offset
            limit = self._int(i, "Temperature", "GPU Current Temp") + self._int(i, "Temperature", "GPU T.Limit Temp")
            return limit - self._int(i, "Temperature", f"GPU {word} T.Limit Temp")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, i: int) -> int:
        got = self._call("nvmlDeviceGetCurrentClocksThrottleReasons", i)
        if got is not None:
            return got
        bits = {"HW Slowdown": pynvml.nvmlClocksThrottleReasonHwSlowdown,
                "HW Thermal Slowdown": pynvml.nvmlClocksThrottleReasonHwThermalSlowdown,
                "HW Power Brake Slowdown": pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown,
                "SW Thermal Slowdown": pynvml.nvmlClocksThrottleReasonSwThermalSlowdown}
        mask = 0
        for ancestors, k, v in self._gpus[i]:
            if k in bits and v == "Active" and any("Clocks" in a and "Reasons" in a for a in ancestors):
                mask |= bits[k]
        return mask

    def _link(self, i: int, section: str, key: str) -> int:
        for ancestors, k, v in self._gpus[i]:
            if k == key and ancestors and ancestors[-1] == section and v not in ("", "N/A"):
                return int(v.rstrip("x"))
        raise _not_supported()

    def nvmlDeviceGetCurrPcieLinkWidth(self, i: int) -> int:
        got = self._call("nvmlDeviceGetCurrPcieLinkWidth", i)
        return got if got is not None else self._link(i, "Link Width", "Current")

    def nvmlDeviceGetMaxPcieLinkWidth(self, i: int) -> int:
        return self._link(i, "Link Width", "Max")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, i: int) -> int:
        return self._link(i, "PCIe Generation", "Current")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, i: int) -> int:
        return self._link(i, "PCIe Generation", "Max")

    def nvmlDeviceGetNvLinkState(self, i: int, link: int) -> int:
        got = self._call("nvmlDeviceGetNvLinkState", i)
        if got is None:  # nvidia-smi -q does not print NVLink state
            raise _not_supported()
        return got.get(link, pynvml.NVML_FEATURE_DISABLED) if isinstance(got, dict) else got

    def nvmlDeviceGetNvLinkErrorCounter(self, i: int, link: int, counter: int) -> int:
        got = self._call("nvmlDeviceGetNvLinkErrorCounter", i) or {}
        return got.get((link, counter), 0)

    def nvmlDeviceGetFieldValues(self, i: int, fields: list[int]) -> list[SimpleNamespace]:
        """The recovery action: the "GPU Recovery Action" line nvidia-smi prints (580), else the
        "GPU Reset Status" section (535+)."""
        got = self._call("nvmlDeviceGetFieldValues", i)
        if got is not None:
            return [SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS, value=SimpleNamespace(uiVal=got))]
        try:
            text = self._field(i, None, "GPU Recovery Action")
        except pynvml.NVMLError:
            text = None
        if text is not None:
            if text not in _RECOVERY_ACTION_TEXT:
                raise ValueError(f"fake_nvml: unknown GPU Recovery Action {text!r}: add it to _RECOVERY_ACTION_TEXT")
            return [SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS,
                                    value=SimpleNamespace(uiVal=_RECOVERY_ACTION_TEXT[text]))]
        try:
            reset = self._field(i, "GPU Reset Status", "Reset Required") == "Yes"
            drain = self._field(i, "GPU Reset Status", "Drain and Reset Recommended") == "Yes"
        except pynvml.NVMLError:
            return [SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED, value=None)]
        action = (pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET if drain
                  else pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET if reset else pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
        return [SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS, value=SimpleNamespace(uiVal=action))]
