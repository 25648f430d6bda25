"""dcgmi health / diag parsing and checks on real DCGM outputs (tests/fixtures/health/dcgmi-*)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.health import dcgm
from slurmft.health.facts import Facts, Unavailable
from slurmft.health.proc import ProcResult
from slurmft.health.registry import run_guarded
from slurmft.health.result import Status
from slurmft.health.state import HealthState

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "health"
CFG = dcgm.DcgmConfig()


def check(fn, fact, value):
    facts = Facts({fact: value}, {})
    return run_guarded(fn.__name__[6:], lambda: fn(facts, CFG, HealthState()))


def done(text, rc=0, argv=("dcgmi", "x")):
    return ProcResult(argv, rc, text)


def test_health_json_healthy_shape_from_dcgm_issue_263():
    text = (FIX / "dcgmi-health" / "healthy_json_but-gpu1-needs-reset_DCGM-issue-263.json").read_text()
    assert dcgm.parse_health_json(text) == ("Healthy", [])
    assert check(dcgm.check_dcgm_health, dcgm.HEALTH_FACT, done(text)).status is Status.OK


def test_health_json_failure_names_the_incident():
    text = '{"body": {"Overall Health": {"value": "Failure"}, "GPU 1": {"Memory": "Double Bit ECC Error"}}}'
    r = check(dcgm.check_dcgm_health, dcgm.HEALTH_FACT, done(text))
    assert r.status is Status.FAIL and r.detail == "GPU 1 Memory: Double Bit ECC Error"


def test_health_unreadable_or_hung_fails():
    r = check(dcgm.check_dcgm_health, dcgm.HEALTH_FACT, done("Error: unable to connect to host engine", rc=255))
    assert r.status is Status.FAIL and "Error: unable to connect to host engine" in r.detail
    r = check(dcgm.check_dcgm_health, dcgm.HEALTH_FACT, ProcResult(("dcgmi", "health"), None, ""))
    assert r.status is Status.FAIL and r.detail == "dcgmi health timed out after 10 s"


def test_missing_dcgmi_is_skipped():
    assert isinstance(dcgm.run_dcgmi(("dcgmi-not-here", "health"), 1.0), Unavailable)
    r = check(dcgm.check_dcgm_health, dcgm.HEALTH_FACT, Unavailable("dcgmi not installed"))
    assert r.status is Status.SKIPPED and r.detail == "dcgmi not installed"


def test_diag_pass_table():
    text = (FIX / "dcgmi-diag" / "pass_r2_a100-sxm4-80gb-x8_dcgm-3.3.3_driver-535.104.12.txt").read_text()
    r = check(dcgm.check_dcgm_diag, dcgm.DIAG_FACT, done(text))
    assert r.status is Status.OK and r.detail == "dcgmi diag: 14 rows, all pass"


def test_diag_deployment_error_wrapped_over_two_lines():
    text = (FIX / "dcgmi-diag" / "FRAGMENT_fail_row-remap-pending_deployment.txt").read_text()
    r = check(dcgm.check_dcgm_diag, dcgm.DIAG_FACT, done(text))
    assert r.status is Status.FAIL
    assert r.detail == "Error: GPU 3 has uncorrectable memory errors and row remappings are pending"


def test_diag_split_result_and_midword_wrapped_warning():
    text = (FIX / "dcgmi-diag" / "FRAGMENT_fail_r2_gpu-memory_thermal-warning.txt").read_text()
    rows = dict(dcgm.parse_diag_table(text))
    assert rows["GPU Memory"] == "Pass - GPUs: 1, 2, 3, 4, 5, 6, 7 / Fail - GPU: 0"
    assert rows["Warning"].startswith("GPU 0 Thermal violations totaling 13.3 seconds started at 9.7 seconds")
    r = check(dcgm.check_dcgm_diag, dcgm.DIAG_FACT, done(text))
    assert r.status is Status.FAIL and r.detail.startswith("GPU Memory: Pass - GPUs: 1, 2, 3, 4, 5, 6, 7 / Fail - GPU: 0")


@pytest.mark.parametrize("argv", [[], ["dcgmi", ""], "dcgmi health"])
def test_bad_argv_is_rejected(argv):
    with pytest.raises(ValueError):
        dcgm.DcgmConfig(health_argv=argv)


def test_dcgm_healthy_does_not_hide_an_xid(tmp_path):
    """DCGM#263: `dcgmi health` said Healthy on a node whose GPU needed a reset. The sweep runs the
    Xid check beside it, so the node still fails. dcgmi is a stand-in script printing the real
    JSON; the Xid line is a real one (tests/fixtures/health/xid/kernel_lines.tsv)."""
    from slurmft.health.registry import HealthConfig, plan, run_plan
    from slurmft.health.xid import XidConfig

    fake = tmp_path / "dcgmi"
    fake.write_text(f"#!/bin/sh\ncat {FIX / 'dcgmi-health' / 'healthy_json_but-gpu1-needs-reset_DCGM-issue-263.json'}\n")
    fake.chmod(0o755)
    log = tmp_path / "kern.log"
    log.write_text("[6781741.548779] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, "
                   "GPU has fallen off the bus.\n")
    hc = HealthConfig(dcgm=dcgm.DcgmConfig(health_argv=(str(fake), "health", "-c", "-j")),
                      xid=XidConfig(source="file", path=log))
    results, _ = run_plan(plan(("dcgm_health", "gpu_xid"), hc, "normal"), hc, HealthState(), 10.0)
    by = {r.check: r.status for r in results}
    assert by == {"dcgm_health": Status.OK, "gpu_xid": Status.FAIL}
