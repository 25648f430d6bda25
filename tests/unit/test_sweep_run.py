"""One sweep end to end without a controller: report JSON, Prometheus textfile, dry run, lock,
state across runs. Slurm is an in-memory SlurmClient here (the real one is exercised in
tests/integration/test_sweep.py against the devcluster)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurmft.config import ConfigError
from slurmft.health.external import ExternalCheck, ExternalConfig
from slurmft.health.registry import HealthConfig
from slurmft.slurm.client import Node, NodeState, SlurmUnavailable
from slurmft.sweep.config import SweepConfig
from slurmft.sweep.lock import LockHeld, SweepLock
from slurmft.sweep.run import SweepRequest, lock_path, sweep


class MemorySlurm:
    """nodes/drain/resume over a dict, recording every change."""

    def __init__(self, names=("n1", "n2", "n3", "n4"), down=False):
        self.state = {n: Node(n, NodeState.IDLE) for n in names}
        self.calls: list[tuple[str, str]] = []
        self.down = down

    def nodes(self, names=None):
        if self.down:
            raise SlurmUnavailable("slurm_load_node error: Unable to contact slurm controller")
        return dict(self.state)

    def drain(self, node, reason):
        self.calls.append(("drain", node))
        self.state[node] = Node(node, NodeState.IDLE, frozenset({"DRAIN"}), reason)

    def resume(self, node):
        self.calls.append(("resume", node))
        self.state[node] = Node(node, NodeState.IDLE)


def configs(tmp_path, exit_code=0):
    flag = tmp_path / "exit-code"
    flag.write_text(str(exit_code))
    script = tmp_path / "site-check"
    script.write_text(f"#!/bin/sh\necho 'site check says {exit_code}'\nexit $(cat {flag})\n")
    script.chmod(0o755)
    cfg = SweepConfig(checks=("node_memory", "external_site"), state_dir=tmp_path / "state",
                      report_dir=tmp_path / "reports", textfile_dir=tmp_path / "textfile")
    hc = HealthConfig(external=ExternalConfig(commands=(ExternalCheck("site", (str(script),)),)))
    return cfg, hc, flag


def metrics(path):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(path.read_text()) for s in fam.samples}


def test_fail_drains_then_pass_resumes_and_reports(tmp_path):
    cfg, hc, flag = configs(tmp_path, exit_code=1)
    slurm = MemorySlurm()
    report = sweep(SweepRequest("n2"), cfg, hc, slurm)
    assert slurm.calls == [("drain", "n2")] and report.outcome.acted == "drained"
    assert slurm.state["n2"].reason == "slurmft: external_site: site check says 1"

    doc = json.loads((tmp_path / "reports" / "n2.json").read_text())
    assert doc["status"] == "fail" and doc["decision"]["action"] == "drain" and doc["acted"] == "drained"
    assert {"check": "external_site", "status": "fail", "detail": "site check says 1"} in doc["results"]
    assert set(doc["fact_seconds"]) == {"memory", "external_site"}
    m = metrics(tmp_path / "textfile" / "slurmft_sweep_n2.prom")
    assert m[("slurmft_sweep_node_healthy", (("node", "n2"),))] == 0
    assert m[("slurmft_health_check_status", (("check", "external_site"), ("node", "n2"), ("status", "fail")))] == 1
    assert m[("slurmft_sweep_action", (("action", "drain"), ("node", "n2")))] == 1

    flag.write_text("0")
    report = sweep(SweepRequest("n2"), cfg, hc, slurm)
    assert slurm.calls[-1] == ("resume", "n2") and report.healthy
    assert metrics(tmp_path / "textfile" / "slurmft_sweep_n2.prom")[("slurmft_sweep_node_healthy", (("node", "n2"),))] == 1


def test_dry_run_decides_but_touches_nothing(tmp_path):
    cfg, hc, _ = configs(tmp_path, exit_code=1)
    slurm = MemorySlurm()
    report = sweep(SweepRequest("n1", dry_run=True), cfg, hc, slurm)
    assert report.decision.action.value == "drain" and slurm.calls == []
    assert not (tmp_path / "reports").exists() and not (tmp_path / "textfile").exists()
    assert not (tmp_path / "state" / "health-n1.json").exists()


def test_guard_blocks_and_exports_the_alert(tmp_path):
    cfg, hc, _ = configs(tmp_path, exit_code=1)
    slurm = MemorySlurm()
    slurm.drain("n4", "slurmft: node_disk: full")
    report = sweep(SweepRequest("n1"), cfg, hc, slurm)
    assert report.decision.action.value == "blocked" and slurm.calls == [("drain", "n4")]
    m = metrics(tmp_path / "textfile" / "slurmft_sweep_n1.prom")
    assert m[("slurmft_sweep_blast_radius_blocked", (("node", "n1"),))] == 1
    assert m[("slurmft_sweep_nodes_drained_by_slurmft", (("node", "n1"),))] == 1


def test_unreachable_controller_still_reports_checks_and_acts_on_nothing(tmp_path):
    cfg, hc, _ = configs(tmp_path, exit_code=1)
    slurm = MemorySlurm(down=True)
    report = sweep(SweepRequest("n1"), cfg, hc, slurm)
    assert report.decision is None and "Unable to contact slurm controller" in report.slurm_error
    assert slurm.calls == [] and json.loads((tmp_path / "reports" / "n1.json").read_text())["status"] == "fail"


def test_unknown_node_or_check_is_a_config_error_before_anything_runs(tmp_path):
    cfg, hc, _ = configs(tmp_path, exit_code=1)
    slurm = MemorySlurm()
    with pytest.raises(ConfigError, match="--node 'n9': Slurm knows no such node"):
        sweep(SweepRequest("n9"), cfg, hc, slurm)
    bad = SweepConfig(checks=("gpu_tmp",), state_dir=tmp_path / "s")
    with pytest.raises(ConfigError, match=r"unknown check 'gpu_tmp'"):
        sweep(SweepRequest("n1"), bad, hc, slurm)
    assert slurm.calls == [] and not (tmp_path / "reports").exists()


def test_second_sweep_on_the_same_node_is_refused_while_one_runs(tmp_path):
    cfg, hc, _ = configs(tmp_path)
    with SweepLock(lock_path(cfg, "n1")):
        with pytest.raises(LockHeld):
            sweep(SweepRequest("n1"), cfg, hc, MemorySlurm())
    assert sweep(SweepRequest("n1"), cfg, hc, MemorySlurm()).healthy  # released


def test_sweep_config_rejects_bad_share(tmp_path):
    from slurmft.config import load_section

    f = tmp_path / "slurmft.toml"
    f.write_text("[sweep]\nmax_drain_share = 1.5\n")
    with pytest.raises(ConfigError, match=r"\[sweep\] max_drain_share must be between 0 and 1"):
        load_section(SweepConfig, "sweep", config_file=f, environ={})
    f.write_text('[sweep]\nchecks = ["gpu_ecc"]\nfact_timeout_s = "soon"\n')
    with pytest.raises(ConfigError, match=r"\[sweep\] fact_timeout_s must be a number"):
        load_section(SweepConfig, "sweep", config_file=f, environ={})


def test_decision_uses_the_nodes_as_they_are_after_the_checks(tmp_path):
    """A human drains the node while its (slow) checks run: the sweep must not drain over it."""
    cfg, hc, _ = configs(tmp_path, exit_code=1)

    class DrainedMeanwhile(MemorySlurm):
        reads = 0

        def nodes(self, names=None):
            self.reads += 1
            if self.reads == 2:
                self.state["n1"] = Node("n1", NodeState.IDLE, frozenset({"DRAIN"}), "hands-on repair")
            return super().nodes(names)

    slurm = DrainedMeanwhile()
    report = sweep(SweepRequest("n1"), cfg, hc, slurm)
    assert report.decision.action.value == "none" and "someone else (hands-on repair)" in report.decision.why
    assert slurm.calls == [] and slurm.state["n1"].reason == "hands-on repair"


def gpu_configs(tmp_path):
    cfg = SweepConfig(checks=("gpu_memory_remap",), state_dir=tmp_path / "state",
                      report_dir=tmp_path / "reports", textfile_dir=tmp_path / "textfile")
    return cfg, HealthConfig()


class DriverGone:
    """NVML whose driver is not loaded: every GPU check is skipped."""

    import pynvml as _pynvml
    NVMLError = _pynvml.NVMLError

    def nvmlInit(self):
        raise self._pynvml.NVMLError(self._pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


def test_a_drain_is_kept_when_the_check_behind_it_can_no_longer_run(tmp_path):
    from fake_nvml import FakeNvml

    cfg, hc = gpu_configs(tmp_path)
    slurm = MemorySlurm()
    bad = FakeNvml.from_fixture("a10_driver-535.129.03_remapped-rows-pending.txt")
    assert sweep(SweepRequest("n1"), cfg, hc, slurm, nvml=bad).outcome.acted == "drained"
    report = sweep(SweepRequest("n1"), cfg, hc, slurm, nvml=DriverGone())
    assert [r.status.value for r in report.results] == ["skipped"] and report.healthy
    assert report.decision.action.value == "keep" and report.outcome.acted == ""
    assert "gpu_memory_remap could not run (NVML not available: Driver Not Loaded)" in report.decision.why
    assert slurm.calls == [("drain", "n1")] and slurm.state["n1"].drained
    m = metrics(tmp_path / "textfile" / "slurmft_sweep_n1.prom")
    assert m[("slurmft_sweep_action", (("action", "keep"), ("node", "n1")))] == 1


def test_the_drain_is_recorded_before_it_is_made(tmp_path):
    cfg, hc, _ = configs(tmp_path, exit_code=1)
    state_file = tmp_path / "state" / "health-n1.json"

    class Checking(MemorySlurm):
        def drain(self, node, reason):
            saved = json.loads(state_file.read_text())["data"]["drain"]
            assert saved["reason"] == reason and saved["checks"] == ["external_site"]
            super().drain(node, reason)

    slurm = Checking()
    assert sweep(SweepRequest("n1"), cfg, hc, slurm).outcome.acted == "drained"
    assert slurm.calls == [("drain", "n1")]


def test_a_write_failure_after_draining_still_reports_the_drain(tmp_path):
    cfg, hc, _ = configs(tmp_path, exit_code=1)
    (tmp_path / "state" / "health-n1.json").mkdir(parents=True)  # the state cannot be written
    (tmp_path / "reports").write_text("a file where the report dir should be")
    slurm = MemorySlurm()
    report = sweep(SweepRequest("n1"), cfg, hc, slurm)
    assert slurm.calls == [("drain", "n1")] and report.outcome.acted == "drained"
    assert [e.split(":")[0] for e in report.write_errors] == [
        "state (before draining)", "state", "report"]
    m = metrics(tmp_path / "textfile" / "slurmft_sweep_n1.prom")  # written last: it says so
    assert m[("slurmft_sweep_write_error", (("node", "n1"),))] == 1
    assert m[("slurmft_sweep_action", (("action", "drain"), ("node", "n1")))] == 1


class AfterDrain(MemorySlurm):
    """Another sweep's drain lands with ours, or the controller stops answering after it."""

    def __init__(self, racer=None, fail_read=False, fail_resume=False):
        super().__init__()
        self.racer, self.fail_read, self.fail_resume = racer, fail_read, fail_resume
        self.drained_once = False

    def drain(self, node, reason):
        super().drain(node, reason)
        if self.racer:
            self.state[self.racer] = Node(self.racer, NodeState.IDLE, frozenset({"DRAIN"}),
                                          "slurmft: node_mounts: /lustre gone")
        self.drained_once = True

    def nodes(self, names=None):
        if self.drained_once and self.fail_read:
            raise SlurmUnavailable("Socket timed out on send/recv operation")
        return super().nodes(names)

    def resume(self, node):
        if self.fail_resume:
            raise SlurmUnavailable("Unable to contact slurm controller")
        super().resume(node)


@pytest.mark.parametrize("slurm, acted, error, calls", [
    (AfterDrain(fail_read=True), "drained",
     "could not re-read the nodes to check the blast-radius guard", [("drain", "n1")]),
    (AfterDrain(racer="n3"), "drain withdrawn (race)", "", [("drain", "n1"), ("resume", "n1")]),
    (AfterDrain(racer="n3", fail_resume=True), "drained", "withdrawing this drain failed",
     [("drain", "n1")]),
])
def test_what_happened_after_a_drain_is_what_is_reported(tmp_path, slurm, acted, error, calls):
    cfg, hc, _ = configs(tmp_path, exit_code=1)
    report = sweep(SweepRequest("n1"), cfg, hc, slurm)
    assert report.outcome.acted == acted and slurm.calls == calls
    assert (error in report.outcome.error) if error else report.outcome.error == ""
    doc = json.loads((tmp_path / "reports" / "n1.json").read_text())
    assert doc["acted"] == acted


def test_a_drain_that_may_have_happened_is_not_reported_as_not_done(tmp_path):
    from slurmft.slurm.client import OutcomeUnknown

    class NoAnswer(MemorySlurm):
        def drain(self, node, reason):
            super().drain(node, reason)
            raise OutcomeUnknown("scontrol update: no answer within 20 s; and re-reading the "
                                 "state to check failed too")

    cfg, hc, _ = configs(tmp_path, exit_code=1)
    report = sweep(SweepRequest("n1"), cfg, hc, NoAnswer())
    assert report.outcome.acted == "drain may have happened (no answer, and the node could not be read back)"
    assert "OutcomeUnknown: scontrol update: no answer" in report.outcome.error


def test_an_ecc_drain_is_kept_when_the_faulty_gpu_falls_off_the_bus(tmp_path):
    from fake_nvml import FakeNvml

    cfg, hc = gpu_configs(tmp_path)
    cfg = replace(cfg, checks=("gpu_ecc",))
    slurm = MemorySlurm()
    h100 = "h100-sxm-x8_driver-535.161.08.txt"
    assert sweep(SweepRequest("n1"), cfg, hc, slurm, nvml=FakeNvml.from_fixture(h100)).healthy
    errors = FakeNvml.from_fixture(h100, overrides={("nvmlDeviceGetTotalEccErrors", 7): 3})
    assert sweep(SweepRequest("n1"), cfg, hc, slurm, nvml=errors).outcome.acted == "drained"
    gone = FakeNvml.from_fixture(h100, overrides={("nvmlDeviceGetCount", -1): 7})
    report = sweep(SweepRequest("n1"), cfg, hc, slurm, nvml=gone)
    assert report.decision.action.value == "keep" and slurm.state["n1"].drained
    assert "gpu_ecc could not run (GPU(s) 0000:db:00.0 seen by an earlier sweep are gone" in report.decision.why


def xid_configs(tmp_path, monkeypatch):
    """A sweep of gpu_xid over a kernel log file this test writes, in boot ``boot-1``."""
    from slurmft.health import xid

    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    monkeypatch.setattr(xid, "BOOT_ID", boot)
    log = tmp_path / "kern.log"
    log.write_text("[6781741.5] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, "
                   "GPU has fallen off the bus.\n")
    cfg = SweepConfig(checks=("gpu_xid",), state_dir=tmp_path / "state",
                      report_dir=tmp_path / "reports", textfile_dir=tmp_path / "textfile")
    return cfg, HealthConfig(xid=xid.XidConfig(source="file", path=log)), boot


def rotate(log):
    """The kernel log is rotated: the Xid 79 line is no longer in it (only the memory has it)."""
    log.unlink()
    log.write_text("[6781800.0] usb 1-1: new high-speed USB device number 3\n")


@pytest.mark.parametrize("damage", [
    b"{not json",
    b"",
    b'{"version": 1, "data": {"xid": {"boot_id": "boot-1", "position": {"inode": 1, "offset": "0"},'
    b' "remembered": []}}}',
    b'{"version": 1, "data": {"xid": {"boot_id": "boot-1", "position": {"kmsg_seq": NaN},'
    b' "remembered": []}}}',
    b'{"version": 1, "data": {"drain": {"reason": "x", "checks": [1], "at": "t"}}}',
    b'{"version": 1, "data": {"gpu_bus_ids": "0000:91:00.0"}}',
    b'{"version": 1, "data": {"ib_link_downed": {"mlx5_0/1": 1' + b"0" * 5000 + b"}}}",
    b'{"version": 2, "data": {}}',
    b"\xff\xfe not utf-8",
])
def test_an_unreadable_state_keeps_the_fatal_xid_drain(tmp_path, monkeypatch, damage):
    """Issue 26 item 3: a state that cannot be read (or does not check field by field) must not
    make the sweep forget Xid 79 and resume a node whose GPU fell off the bus."""
    cfg, hc, boot = xid_configs(tmp_path, monkeypatch)
    slurm = MemorySlurm()
    report = sweep(SweepRequest("n1"), cfg, hc, slurm)
    assert report.outcome.acted == "drained" and "Xid 79" in slurm.state["n1"].reason
    rotate(hc.xid.path)
    assert sweep(SweepRequest("n1"), cfg, hc, slurm).decision.action.value == "none"  # remembered

    state_file = tmp_path / "state" / "health-n1.json"
    state_file.write_bytes(damage)
    report = sweep(SweepRequest("n1"), cfg, hc, slurm)
    assert [r.status.value for r in report.results] == ["ok"]  # the Xid 79 is forgotten
    assert report.decision.action.value == "keep" and slurm.calls == [("drain", "n1")]
    assert "memory of this node was lost" in report.decision.why
    assert any(f"state file {state_file} unreadable" in n for n in report.notes)
    assert (tmp_path / "state" / "health-n1.json.unreadable").read_bytes() == damage  # kept as it was
    doc = json.loads((tmp_path / "reports" / "n1.json").read_text())
    assert doc["decision"]["action"] == "keep" and doc["notes"]

    report = sweep(SweepRequest("n1"), cfg, hc, slurm)  # the new state remembers the loss
    assert report.decision.action.value == "keep" and slurm.state["n1"].drained

    report = sweep(SweepRequest("n1", forget_xids=True), cfg, hc, slurm)  # the admin reset the GPU
    assert report.outcome.acted == "resumed" and slurm.calls[-1] == ("resume", "n1")


def test_a_lost_memory_lasts_for_its_boot_and_spares_drains_made_after_it(tmp_path, monkeypatch):
    cfg, hc, boot = xid_configs(tmp_path, monkeypatch)
    slurm = MemorySlurm()
    sweep(SweepRequest("n1"), cfg, hc, slurm)
    rotate(hc.xid.path)
    (tmp_path / "state" / "health-n1.json").write_text("{}")
    assert sweep(SweepRequest("n1"), cfg, hc, slurm).decision.action.value == "keep"

    # a drain made after the loss has its record in the new memory: lifted once proven
    (tmp_path / "ext").mkdir()
    ext_cfg, ext_hc, flag = configs(tmp_path / "ext", exit_code=1)
    ext_cfg = replace(ext_cfg, state_dir=cfg.state_dir)
    slurm.resume("n1")
    assert sweep(SweepRequest("n1"), ext_cfg, ext_hc, slurm).outcome.acted == "drained"
    flag.write_text("0")
    assert sweep(SweepRequest("n1"), ext_cfg, ext_hc, slurm).outcome.acted == "resumed"

    slurm.drain("n1", "slurmft: gpu_xid: Xid 79 on 0000:91:00 (GPU has fallen off the bus)")
    assert sweep(SweepRequest("n1"), cfg, hc, slurm).decision.action.value == "keep"
    boot.write_text("boot-2\n")  # rebooted: the loss, like the Xids, belonged to the last boot
    assert sweep(SweepRequest("n1"), cfg, hc, slurm).outcome.acted == "resumed"


def test_a_state_that_cannot_be_kept_aside_is_not_replaced(tmp_path, monkeypatch):
    cfg, hc, _ = xid_configs(tmp_path, monkeypatch)
    slurm = MemorySlurm()
    sweep(SweepRequest("n1"), cfg, hc, slurm)
    rotate(hc.xid.path)
    state_file = tmp_path / "state" / "health-n1.json"
    state_file.write_text("garbage")
    (tmp_path / "state" / "health-n1.json.unreadable" / "in-the-way").mkdir(parents=True)
    report = sweep(SweepRequest("n1"), cfg, hc, slurm)
    assert report.decision.action.value == "keep" and report.write_errors
    assert state_file.read_text() == "garbage"  # still there: the next sweep fails closed too
    assert sweep(SweepRequest("n1"), cfg, hc, slurm).decision.action.value == "keep"
