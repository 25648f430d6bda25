"""Xid parsing against real kernel-log lines of several driver generations, classification from
the one table, and the since-last-sweep position with drain-level Xids remembered for the boot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmft.config import ConfigError, load_section
from slurmft.health import xid
from slurmft.health.facts import gather
from slurmft.health.result import Status
from slurmft.health.state import HealthState

LINES = Path(__file__).resolve().parents[1] / "fixtures" / "health" / "xid" / "kernel_lines.tsv"


def real_lines():
    for row in LINES.read_text().splitlines():
        if row.startswith("#"):
            continue
        code, verdict, source, line = row.split("\t", 3)
        yield pytest.param(code, verdict, line, id=f"{source}-{code}")


@pytest.mark.parametrize("code,verdict,line", list(real_lines()))
def test_real_kernel_lines(code, verdict, line):
    event = xid.parse_line(line)
    if code == "-":
        assert event is None
        return
    assert event is not None and event.code == int(code)
    assert event.verdict == verdict


def test_pci_address_and_body_are_kept():
    e = xid.parse_line("May 10 22:25:01 jambi kernel: [176830.774761] NVRM: Xid (0000:03:00): 13, 0003 00000000")
    assert (e.code, e.pci, e.body) == (13, "0000:03:00", "0003 00000000")


@pytest.mark.parametrize("body,verdict", [
    ("NETIR_BER_EVENT Nonfatal XC0 i0 Link 08 (0x00000000 0x00000000)", "warn"),
    ("NETIR_LINK_EVT  Fatal   XC0 i0 Link 08 (0x00000000)", "drain"),
])
def test_nvlink5_severity_lives_in_the_line(body, verdict):
    assert xid.classify(149, body) == verdict


@pytest.mark.parametrize("body,verdict", [
    ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", "ignore"),
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", "drain"),
    ("GPU recovery action changed from 0x4 (Drain and Reset) to 0x1 (GPU Reset Required)", "drain"),
])
def test_xid154_acts_on_the_target_action(body, verdict):
    assert xid.classify(154, body) == verdict


def test_xid45_body_naming_another_xid_does_not_change_the_code():
    e = xid.parse_line("NVRM: Xid (PCI:0008:01:00): 45, pid=1, name=x, Ch 00000001, caused by previous Xid 149")
    assert e.code == 45


def test_table_covers_the_brief_and_unknown_warns():
    for code in (48, 62, 64, 74, 79, 94, 95, 109, 119, 120, 140):
        assert xid.classify(code, "") == "drain", code
    assert xid.classify(63, "") == xid.classify(92, "") == "warn"
    assert xid.classify(999, "") == "warn"


def _sweep(cfg, state):
    facts = gather({xid.XID_FACT: lambda: xid.gather_xids(cfg, state)}, 5.0)
    return xid.check_gpu_xid(facts, cfg, state)


def test_file_source_reads_only_new_lines_and_remembers_drains(tmp_path, monkeypatch):
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    monkeypatch.setattr(xid, "BOOT_ID", boot)
    log = tmp_path / "kern.log"
    log.write_text("[1.0] NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked\n")
    cfg = xid.XidConfig(source="file", path=log)
    state = HealthState()
    r = _sweep(cfg, state)
    assert r.status is Status.WARN and r.detail == "Xid 63 on 0000:10:1c (row remap / page retirement event, reset to apply)"
    assert _sweep(cfg, state).status is Status.OK  # nothing new

    with log.open("a") as fh:
        fh.write("[6781741.548779] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n")
        fh.write("[6781741.6] NVRM: Xid (PCI:0000:91:00): 13, pid=1, half a li")  # not finished yet
    r = _sweep(cfg, state)
    assert r.status is Status.FAIL and r.detail == ("Xid 79 on 0000:91:00 (GPU has fallen off the bus) "
                                                  "[kept until reboot or slurmft sweep --forget-xids]")
    r = _sweep(cfg, state)  # the line scrolled past; the GPU is still gone
    assert r.status is Status.FAIL

    xid.forget(state)
    assert _sweep(cfg, state).status is Status.OK

    with log.open("a") as fh:
        fh.write("ne\n[7.0] NVRM: Xid (PCI:0000:3b:00): 48, pid=7, Ch 00000008\n")
    assert _sweep(cfg, state).status is Status.FAIL
    boot.write_text("boot-2\n")  # the node rebooted: remembered Xids are dropped, and the
    assert _sweep(cfg, state).status is Status.OK  # old lines still in kern.log are not re-read


def test_rotated_file_is_read_from_the_start(tmp_path, monkeypatch):
    monkeypatch.setattr(xid, "BOOT_ID", tmp_path / "none")
    log = tmp_path / "kern.log"
    log.write_text("x" * 500 + "\n")
    cfg = xid.XidConfig(source="file", path=log)
    state = HealthState()
    assert _sweep(cfg, state).status is Status.OK
    log.unlink()
    log.write_text("NVRM: Xid (PCI:0000:01:00): 119, Timeout after 6s of waiting for RPC response\n")
    assert _sweep(cfg, state).status is Status.FAIL


@pytest.mark.timeout(10)
def test_real_dev_kmsg_reads_without_blocking():
    if not os.access(xid.KMSG, os.R_OK):
        pytest.skip("/dev/kmsg not readable here")
    lines, seq = xid.read_kmsg(-1)
    assert seq >= 0 and isinstance(lines, list)
    again, seq2 = xid.read_kmsg(seq)
    assert seq2 >= seq and len(again) <= 5  # only what the kernel logged in between


def test_config_errors_name_the_key(tmp_path):
    cfg = tmp_path / "slurmft.toml"
    cfg.write_text('[health_xid]\nsource = "file"\n')
    with pytest.raises(ConfigError, match=r"\[health_xid\] path is required"):
        load_section(xid.XidConfig, "health_xid", config_file=cfg, environ={})
    cfg.write_text(f'[health_xid]\nsource = "file"\npath = "{tmp_path}/missing.log"\n')
    with pytest.raises(ConfigError, match=r"\[health_xid\] path .*missing.log does not exist"):
        load_section(xid.XidConfig, "health_xid", config_file=cfg, environ={})
    cfg.write_text('[health_xid]\nsource = "dmesg"\n')
    with pytest.raises(ConfigError, match=r"\[health_xid\] source must be one of 'kmsg', 'file'"):
        load_section(xid.XidConfig, "health_xid", config_file=cfg, environ={})


# Where slurmft's verdict knowingly differs from the catalog's "node action" column, and why.
DEVIATIONS = {
    45: "alone it means 'restart Fabric Manager': a warning, not silence",
    94: "a contained error needs a GPU reset before the remap takes effect: drain (jobs finish, "
        "no new ones) instead of waiting for an idle point that may never come",
}


def catalog_actions():
    text = (LINES.parents[1] / "xid-catalog.md").read_text()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            yield int(cells[0]), cells[4]


def expected_verdict(action: str) -> str | None:
    if action.startswith(("depends", "act on", "ignore when", "NETIR_BER_EVENT")):
        return None  # decided from the line's text: tested above
    if action.startswith("drain"):
        return "drain"
    if action.startswith(("ignore / watch", "ignore now")):
        return "warn"
    if action.startswith("ignore"):
        return "ignore"
    raise AssertionError(f"unmapped catalog action {action!r}")


def test_xid_table_follows_the_catalog_it_cites():
    rows = dict(catalog_actions())
    assert len(rows) >= 30
    for code, action in rows.items():
        want = expected_verdict(action)
        if want is None or code in DEVIATIONS:
            continue
        assert code in xid.XID_TABLE, f"Xid {code} is in the catalog but not in the table"
        assert xid.classify(code, "") == want, f"Xid {code}: catalog says {action!r}"
    assert set(DEVIATIONS) <= set(rows)
