"""NVML checks driven by real nvidia-smi -q outputs (tests/fixtures/health/nvidia-smi-q/)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from fake_nvml import FakeNvml

from slurmft.health import gpu_checks as gc
from slurmft.health.facts import gather
from slurmft.health.gpu import GpuFacts, gather_gpus
from slurmft.health.registry import HealthConfig, plan, run_guarded, run_plan
from slurmft.health.result import Status
from slurmft.health.state import HealthState

H100 = "h100-sxm-x8_driver-535.161.08.txt"
A10 = "a10_driver-535.129.03_remapped-rows-pending.txt"
A100 = "a100-sxm4-80gb_driver-510.73.08_FRAGMENT_row-remap-pending.txt"
RTX = "rtx4090-x8_driver-535.154.05_no-ecc.txt"
TITAN = "titan-v_driver-560.35.03_retired-pages-era.txt"
H200 = "h200_driver-580.159.04.txt"
NVML_FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "health" / "nvml-facts"


def facts_of(fixture: str, **kw):
    nvml = FakeNvml.from_fixture(fixture, **kw)
    return gather({gc.GPU_FACT: lambda: gather_gpus(nvml)}, 5.0)


def run(check, fixture, cfg=gc.GpuConfig(), state=None, **kw):
    facts = facts_of(fixture, **kw)
    return run_guarded(check.__name__[len("check_"):], lambda: check(facts, cfg, state or HealthState()))


def test_h100_node_reads_eight_gpus_with_real_values():
    gpus: GpuFacts = facts_of(H100).need(gc.GPU_FACT)
    assert gpus.driver == "535.161.08"
    assert [d.bus_id for d in gpus.devices][:2] == ["0000:19:00.0", "0000:3b:00.0"]
    d0 = gpus.devices[0]
    assert (d0.temperature_c, d0.slowdown_c, d0.pcie_width, d0.pcie_gen) == (29, 87, 16, 5)
    assert d0.throttle == frozenset({"hw_slowdown", "hw_power_brake"})
    assert d0.recovery_action == 0


def test_h200_nvidia_smi_reads_as_the_real_nvml_did():
    """Both fixtures are from one real H200 (driver 580.159.04), captured in the same run of
    benchmarks/gpu_check.py: its nvidia-smi -q, and what gather_gpus read from the real NVML.
    The stand-in driven by the first must give exactly the second (the recovery action too,
    which driver 580 prints as "GPU Recovery Action", not as 535's "GPU Reset Status")."""
    gpus: GpuFacts = facts_of(H200).need(gc.GPU_FACT)
    real = json.loads((NVML_FACTS / H200.replace(".txt", ".json")).read_text())
    fake = [{**dataclasses.asdict(d), "throttle": sorted(d.throttle or ())} for d in gpus.devices]
    assert gpus.driver == real["driver"] == "580.159.04"
    assert json.loads(json.dumps(fake)) == real["devices"]
    assert real["devices"][0]["recovery_action"] == 0 and real["devices"][0]["name"] == "NVIDIA H200"
    for check in (gc.check_gpu_count, gc.check_gpu_ecc, gc.check_gpu_memory_remap,
                  gc.check_gpu_recovery_action, gc.check_gpu_temperature, gc.check_gpu_throttle,
                  gc.check_gpu_pcie):
        assert run(check, H200).status is Status.OK, check.__name__   # as on the real H200
    assert run(gc.check_gpu_nvlink, H200).status is Status.SKIPPED   # a lone PCIe H200: no NVLink


def test_newer_recovery_actions_are_named():
    r = run(gc.check_gpu_recovery_action, H200, overrides={("nvmlDeviceGetFieldValues", 0): 6})
    assert r.status is Status.FAIL and r.detail == "GPU 0 (0000:00:06.0): recovery action Bus Reset"


def test_count_matches_or_names_the_shortfall():
    assert run(gc.check_gpu_count, H100, gc.GpuConfig(expected_count=8)).status is Status.OK
    r = run(gc.check_gpu_count, H100, gc.GpuConfig(expected_count=9))
    assert r.status is Status.FAIL and r.detail == "expected 9 GPUs, NVML sees 8"


def test_h100_hw_slowdown_and_power_brake_warn_by_default_fail_when_configured():
    r = run(gc.check_gpu_throttle, H100)
    assert r.status is Status.WARN and "GPU 0 (0000:19:00.0): clocks throttled (hw_power_brake, hw_slowdown)" in r.detail
    r = run(gc.check_gpu_throttle, H100, gc.GpuConfig(throttle_fail=("hw_slowdown",)))
    assert r.status is Status.FAIL and r.detail.startswith("GPU 0 (0000:19:00.0): clocks throttled (hw_slowdown)")


def test_a10_uncorrectable_remap_pending_fails():
    r = run(gc.check_gpu_memory_remap, A10)
    assert r.status is Status.FAIL
    assert r.detail == "GPU 0 (0000:07:00.0): 4 uncorrectable-error row remaps pending, GPU reset required"


def test_a100_correctable_remap_pending_only_warns():
    r = run(gc.check_gpu_memory_remap, A100)
    assert r.status is Status.WARN and "0000:10:1c.0" in r.detail


def test_retired_pages_pending_fails():
    r = run(gc.check_gpu_memory_remap, "FRAGMENT_retired-pages-pending.txt")
    assert r.status is Status.FAIL and "retired pages pending" in r.detail


def test_sram_uncorrectable_counts_as_volatile_dbe():
    r = run(gc.check_gpu_ecc, "FRAGMENT_sram-uncorrectable.txt")
    assert r.status is Status.FAIL and "1 volatile double-bit ECC errors" in r.detail
    assert run(gc.check_gpu_ecc, H100).status is Status.OK


def test_consumer_gpu_without_ecc_is_no_proof_and_no_fault():
    gpus = facts_of(RTX).need(gc.GPU_FACT)
    assert all(d.ecc_dbe_volatile is None for d in gpus.devices)
    r = run(gc.check_gpu_ecc, RTX)  # skipped: never drains, never lifts a gpu_ecc drain
    assert r.status is Status.SKIPPED and r.detail.startswith("ECC error counters unreadable on GPU 0")
    r = run(gc.check_gpu_recovery_action, RTX)  # this 535 output has no "GPU Reset Status"
    assert r.status is Status.SKIPPED and r.detail == "driver 535.154.05 does not report a GPU recovery action"


def test_idle_gen1_link_is_ignored_unless_configured():
    assert run(gc.check_gpu_pcie, RTX).status is Status.OK
    r = run(gc.check_gpu_pcie, RTX, gc.GpuConfig(pcie_gen_below_max="warn"))
    assert r.status is Status.WARN and "PCIe Gen1 below max Gen4" in r.detail


def test_degraded_link_width_fails():
    r = run(gc.check_gpu_pcie, H100, overrides={("nvmlDeviceGetCurrPcieLinkWidth", 3): 8})
    assert r.status is Status.FAIL
    assert r.detail == "GPU 3 (0000:5d:00.0): PCIe link x8 below device max x16"


def test_temperature_against_slowdown_and_absolute_threshold():
    assert run(gc.check_gpu_temperature, TITAN).status is Status.OK
    r = run(gc.check_gpu_temperature, TITAN, gc.GpuConfig(temp_fail_c=44))
    assert r.status is Status.FAIL and r.detail == "GPU 0 (0000:01:00.0): 44 C >= 44 C"
    r = run(gc.check_gpu_temperature, TITAN, gc.GpuConfig(temp_fail_c=48))
    assert r.status is Status.WARN


def test_recovery_action_reported_by_driver():
    assert run(gc.check_gpu_recovery_action, H100).status is Status.OK
    r = run(gc.check_gpu_recovery_action, H100, overrides={("nvmlDeviceGetFieldValues", 1): 2})
    assert r.status is Status.FAIL and r.detail == "GPU 1 (0000:3b:00.0): recovery action Node Reboot Required"
    assert run(gc.check_gpu_recovery_action, TITAN).status is Status.SKIPPED


def test_nvlink_counters_rising_between_sweeps_fail():
    state = HealthState()
    up = {("nvmlDeviceGetNvLinkState", i): {0: 1, 1: 1} for i in range(8)}
    first = {**up, ("nvmlDeviceGetNvLinkErrorCounter", 2): {(0, 0): 5}}
    assert run(gc.check_gpu_nvlink, H100, state=state, overrides=first).status is Status.OK
    same = run(gc.check_gpu_nvlink, H100, state=state, overrides=first)
    assert same.status is Status.OK
    rose = {**up, ("nvmlDeviceGetNvLinkErrorCounter", 2): {(0, 0): 9, (1, 3): 2}}
    r = run(gc.check_gpu_nvlink, H100, state=state, overrides=rose)
    assert r.status is Status.FAIL and r.detail == "GPU 2 (0000:4c:00.0): NVLink errors rose by 6 since the last sweep"
    down = {**up, ("nvmlDeviceGetNvLinkState", 5): {0: 1}}
    r = run(gc.check_gpu_nvlink, H100, gc.GpuConfig(nvlink_expected_active=2), state=state, overrides=down)
    assert r.status is Status.FAIL and "GPU 5 (0000:bb:00.0): 1 NVLinks active, expected 2" in r.detail


def test_no_nvml_skips_unless_gpus_are_expected():
    hc = HealthConfig()
    results, _ = run_plan(plan(("gpu_count", "gpu_ecc"), hc, "normal"), hc, HealthState(), 5.0)
    assert [r.status for r in results] == [Status.SKIPPED, Status.SKIPPED]
    assert "NVML" in results[0].detail
    hc = HealthConfig(gpu=gc.GpuConfig(expected_count=8))
    results, _ = run_plan(plan(("gpu_count",), hc, "normal"), hc, HealthState(), 5.0)
    assert results[0].status is Status.FAIL and results[0].detail.startswith("expected 8 GPUs, found none")


@pytest.mark.timeout(10)
def test_hanging_nvml_becomes_a_failed_result_naming_it():
    hc = HealthConfig()
    nvml = FakeNvml.from_fixture(H100, hang="nvmlDeviceGetCount")
    results, facts = run_plan(plan(("gpu_count", "gpu_ecc", "node_memory"), hc, "normal"), hc,
                              HealthState(), 0.3, nvml=nvml)
    by = {r.check: r for r in results}
    assert by["gpu_count"].status is Status.FAIL and by["gpu_count"].detail == "gpu: timed out after 0.3 s"
    assert by["gpu_ecc"].status is Status.FAIL
    assert by["node_memory"].status is Status.OK  # other sources are not held up


def test_bad_gpu_config_names_the_key(tmp_path):
    from slurmft.config import ConfigError
    from slurmft.health.registry import load_health_config

    cfg = tmp_path / "slurmft.toml"
    cfg.write_text('[health_gpu]\nexpected_count = "eight"\n')
    with pytest.raises(ConfigError, match=r"\[health_gpu\] expected_count must be an integer"):
        load_health_config(cfg, environ={})
    cfg.write_text('[health_gpu]\nthrottle_fail = ["hw_thermal", "hot"]\n')
    with pytest.raises(ConfigError, match=r"\[health_gpu\] throttle_fail: unknown throttle reason 'hot'"):
        load_health_config(cfg, environ={})


def test_ecc_and_remap_are_no_proof_when_a_gpu_has_gone_or_none_is_seen():
    # Before: a GPU with double-bit errors that fell off the bus took its counters with it, and the
    # remaining GPUs' clean counters lifted the gpu_ecc drain.
    state = HealthState()
    assert run(gc.check_gpu_ecc, H100, state=state).status is Status.OK
    seven = {("nvmlDeviceGetCount", -1): 7}
    for check in (gc.check_gpu_ecc, gc.check_gpu_memory_remap):
        r = run(check, H100, state=state, overrides=seven)
        assert r.status is Status.SKIPPED and "GPU(s) 0000:db:00.0 seen by an earlier sweep are gone" in r.detail
    none = run(gc.check_gpu_ecc, H100, state=HealthState(), overrides={("nvmlDeviceGetCount", -1): 0})
    assert none.status is Status.SKIPPED and none.detail == "NVML sees no GPU: no ECC error counters to read"
    assert run(gc.check_gpu_ecc, H100, state=state).status is Status.OK  # all eight back


def test_ecc_errors_fail_even_when_another_gpu_cannot_be_read():
    r = run(gc.check_gpu_ecc, H100, overrides={("nvmlDeviceGetTotalEccErrors", 3): 2,
                                               ("nvmlDeviceGetCount", -1): 8})
    assert r.status is Status.FAIL and "GPU 3" in r.detail
