"""Node checks (disk, mounts, InfiniBand, memory) and external checks, on real files in tmp dirs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slurmft.config import ConfigError
from slurmft.health import node
from slurmft.health.external import ExternalCheck, ExternalConfig
from slurmft.health.facts import gather
from slurmft.health.registry import HealthConfig, load_health_config, plan, run_guarded, run_plan
from slurmft.health.result import Status
from slurmft.health.state import HealthState


def one(check, fact, gatherer, cfg, state=None):
    facts = gather({fact: gatherer}, 5.0)
    return run_guarded(check.__name__[6:], lambda: check(facts, cfg, state or HealthState()))


def test_disk_free_space(tmp_path):
    cfg = node.NodeConfig(disk_paths=(tmp_path,), disk_min_free_gib=0.0, disk_min_free_percent=0.0)
    assert one(node.check_node_disk, node.DISK_FACT, lambda: node.gather_disk(cfg.disk_paths), cfg).status is Status.OK
    cfg = node.NodeConfig(disk_paths=(tmp_path,), disk_min_free_gib=1e9)
    r = one(node.check_node_disk, node.DISK_FACT, lambda: node.gather_disk(cfg.disk_paths), cfg)
    assert r.status is Status.FAIL and r.detail.startswith(f"{tmp_path}: ") and "need 1e+09 GiB" in r.detail


def test_required_mounts():
    cfg = node.NodeConfig(required_mounts=(Path("/"), Path("/proc")))
    assert one(node.check_node_mounts, node.MOUNT_FACT, node.gather_mounts, cfg).status is Status.OK
    cfg = node.NodeConfig(required_mounts=(Path("/"), Path("/lustre/scratch")))
    r = one(node.check_node_mounts, node.MOUNT_FACT, node.gather_mounts, cfg)
    assert r.status is Status.FAIL and r.detail == "/lustre/scratch not mounted"


def make_port(root: Path, dev: str, port: str, state: str, downed: int) -> None:
    p = root / dev / "ports" / port
    (p / "counters").mkdir(parents=True)
    (p / "state").write_text(state + "\n")
    (p / "counters" / "link_downed").write_text(f"{downed}\n")


def test_infiniband_ports_and_link_downed_rising(tmp_path):
    sysfs = tmp_path / "infiniband"
    make_port(sysfs, "mlx5_0", "1", "4: ACTIVE", 0)
    make_port(sysfs, "mlx5_1", "1", "4: ACTIVE", 3)
    cfg = node.NodeConfig(ib_sysfs=sysfs)
    state = HealthState()
    gather_ib = lambda: node.gather_ib(sysfs)  # noqa: E731
    assert one(node.check_node_ib, node.IB_FACT, gather_ib, cfg, state).status is Status.OK
    (sysfs / "mlx5_1" / "ports" / "1" / "counters" / "link_downed").write_text("4\n")
    (sysfs / "mlx5_0" / "ports" / "1" / "state").write_text("1: DOWN\n")
    r = one(node.check_node_ib, node.IB_FACT, gather_ib, cfg, state)
    assert r.status is Status.FAIL and r.detail == "mlx5_0/1 is DOWN; mlx5_1/1 link_downed rose 3 -> 4"


def test_no_infiniband_skips_unless_required(tmp_path):
    missing = tmp_path / "none"
    r = one(node.check_node_ib, node.IB_FACT, lambda: node.gather_ib(missing), node.NodeConfig(ib_sysfs=missing))
    assert r.status is Status.SKIPPED
    cfg = node.NodeConfig(ib_sysfs=missing, ib_required=True)
    assert one(node.check_node_ib, node.IB_FACT, lambda: node.gather_ib(missing), cfg).status is Status.FAIL


def test_memory(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemAvailable:     524288 kB\n")
    cfg = node.NodeConfig(memory_min_available_gib=1.0)
    r = one(node.check_node_memory, node.MEM_FACT, lambda: node.gather_memory(meminfo), cfg)
    assert r.status is Status.FAIL and r.detail == "0.5 GiB available, need 1 GiB"


def test_external_checks_pass_fail_and_time_out(tmp_path):
    script = tmp_path / "nhc-gpu"
    script.write_text("#!/bin/sh\necho '  ERROR: nv_gpu_count 7 != 8  '\necho more\nexit 1\n")
    script.chmod(0o755)
    hc = HealthConfig(external=ExternalConfig(commands=(
        ExternalCheck("ok", ("true",)),
        ExternalCheck("nhc", (str(script),)),
        ExternalCheck("slow", (sys.executable, "-c", "import time; time.sleep(30)"), timeout_s=0.3),
    )))
    results, _ = run_plan(plan(("external_ok", "external_nhc", "external_slow"), hc, "normal"), hc,
                          HealthState(), 10.0)
    got = {r.check: (r.status, r.detail) for r in results}
    assert got["external_ok"] == (Status.OK, "exit 0")
    assert got["external_nhc"] == (Status.FAIL, "ERROR: nv_gpu_count 7 != 8")
    assert got["external_slow"] == (Status.FAIL, "timed out after 0.3 s")


def test_config_errors_name_the_key(tmp_path):
    cfg = tmp_path / "slurmft.toml"
    cfg.write_text(f'[health_node]\ndisk_paths = ["{tmp_path}", "/no/such/ckpt"]\n')
    with pytest.raises(ConfigError, match=r"\[health_node\] disk_paths\[1\]: /no/such/ckpt does not exist"):
        load_health_config(cfg, environ={})
    cfg.write_text('[[health_external.commands]]\nname = "nhc"\nargv = ["/no/such/nhc"]\n')
    with pytest.raises(ConfigError, match=r"argv\[0\] '/no/such/nhc' does not exist"):
        load_health_config(cfg, environ={})
    cfg.write_text('[[health_external.commands]]\nname = "nhc"\nargv = "nhc -a"\n')  # a string, not argv
    with pytest.raises(ConfigError, match=r"\[health_external\.commands\[0\]\] argv must be a list, got str"):
        load_health_config(cfg, environ={})
    cfg.write_text('[health_node]\nmemory_min_available_gib = "lots"\n')
    with pytest.raises(ConfigError, match=r"\[health_node\] memory_min_available_gib must be a number"):
        load_health_config(cfg, environ={})


def test_plan_rejects_unknown_checks_and_picks_quick_subset():
    hc = HealthConfig(external=ExternalConfig(commands=(ExternalCheck("site", ("true",), quick=True),)))
    with pytest.raises(ConfigError, match=r"\[sweep\] checks\[1\]: unknown check 'gpu_temp'; valid: dcgm_diag"):
        plan(("gpu_ecc", "gpu_temp"), hc, "normal")
    quick = plan((), hc, "quick")
    names = {s.name for s in quick.builtin}
    assert "gpu_temperature" not in names and "dcgm_diag" not in names
    assert {"gpu_xid", "gpu_ecc", "dcgm_health", "node_disk"} <= names
    assert [c.check_name for c in quick.external] == ["external_site"]
    assert "dcgm_diag" not in {s.name for s in plan((), hc, "normal").builtin}
    assert "dcgm_diag" in {s.name for s in plan((), hc, "deep").builtin}


def test_deploy_example_config_is_valid(tmp_path):
    from slurmft.config import load_section
    from slurmft.sweep.config import SweepConfig

    example = (Path(__file__).resolve().parents[2] / "deploy" / "slurmft-sweep.example.toml").read_text()
    for missing in ("/lustre/checkpoints", "/scratch", "/usr/sbin/nhc"):
        example = example.replace(f'"{missing}"', f'"{tmp_path}"')
    (tmp_path / "nhc").write_text("#!/bin/sh\n")
    (tmp_path / "nhc").chmod(0o644)
    cfg = tmp_path / "slurmft.toml"
    cfg.write_text(example.replace(f'argv = ["{tmp_path}"', f'argv = ["{tmp_path}/nhc"'))
    with pytest.raises(ConfigError, match="is not executable"):
        load_health_config(cfg, environ={})
    (tmp_path / "nhc").chmod(0o755)
    cfg = tmp_path / "slurmft.toml"
    cfg.write_text(example.replace(f'argv = ["{tmp_path}"', f'argv = ["{tmp_path}/nhc"'))
    hc = load_health_config(cfg, environ={})
    assert hc.gpu.expected_count == 8 and hc.external.commands[0].check_name == "external_nhc"
    assert load_section(SweepConfig, "sweep", config_file=cfg, environ={}).max_drain_share == 0.10
    from slurmft.slurm.config import SlurmConfig
    assert load_section(SlurmConfig, "slurm", config_file=cfg, environ={}).retries == 1


def test_programs_must_time_out_before_the_sweep_stops_waiting():
    from slurmft.health.registry import check_timeouts

    hc = HealthConfig(external=ExternalConfig(commands=(ExternalCheck("nhc", ("true",), timeout_s=70),)))
    with pytest.raises(ConfigError, match=r"\[health_external\] commands 'nhc' timeout_s = 70 must be below "
                                          r"\[sweep\] fact_timeout_s = 20"):
        check_timeouts(plan((), hc, "normal"), hc, 20.0)
    check_timeouts(plan((), hc, "quick"), hc, 20.0)  # not a quick check: not run, not judged
    check_timeouts(plan(("dcgm_diag",), HealthConfig(), "deep"), HealthConfig(), 20.0)  # deep waits for diag


def test_a_crashing_check_fails_naming_the_error_instead_of_passing():
    def broken():
        raise KeyError("Remapped Rows")

    r = run_guarded("gpu_memory_remap", broken)
    assert r.status is Status.FAIL and r.detail == "check crashed: KeyError: 'Remapped Rows'"
