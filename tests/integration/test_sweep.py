"""``slurmft sweep`` against the real devcluster, run as a subprocess with the cluster's env.

A site "external check" (a script reading a flag file) makes a node fail or pass; Slurm's own
view (through CliSlurmClient) is what the tests assert on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slurmft.slurm.cli import CliSlurmClient

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SLURMFT = Path(sys.executable).parent / "slurmft"
CRON = REPO / "bin" / "slurmft-sweep-cron"


@pytest.fixture
def site(tmp_path):
    """slurmft.toml with one external check whose verdict is the number in ``flag``."""
    flag = tmp_path / "flag"
    flag.write_text("0")
    script = tmp_path / "site-check"
    script.write_text("#!/bin/sh\nsleep \"$(cat %s.sleep 2>/dev/null || echo 0)\"\n"
                      "code=$(cat %s)\n[ \"$code\" = 0 ] && echo 'site check ok' || "
                      "echo 'ERROR: site check: /scratch read-only'\nexit \"$code\"\n" % (flag, flag))
    script.chmod(0o755)
    config = tmp_path / "slurmft.toml"
    config.write_text(f"""
[sweep]
checks = ["node_memory", "external_site"]
state_dir = "{tmp_path}/state"
report_dir = "{tmp_path}/reports"
textfile_dir = "{tmp_path}/textfile"

[[health_external.commands]]
name = "site"
argv = ["{script}"]
timeout_s = 15
""")
    return config, flag


def sweep(cluster, config, node, *extra, timeout=90):
    env = {**os.environ, **cluster.env, "SLURMFT_CONFIG": str(config)}
    return subprocess.run([str(SLURMFT), "sweep", "--node", node, *extra], env=env, text=True,
                          capture_output=True, timeout=timeout)


def scontrol(cluster, *args):
    subprocess.run(["scontrol", *args], env={**os.environ, **cluster.env}, check=True,
                   capture_output=True, timeout=30)


@pytest.mark.timeout(120)
def test_failing_check_drains_and_passing_check_resumes(slurm_cluster, site):
    config, flag = site
    client = CliSlurmClient(env=slurm_cluster.env)
    flag.write_text("1")
    res = sweep(slurm_cluster, config, "n1")
    assert res.returncode == 1, res.stderr
    n1 = client.nodes()["n1"]
    assert n1.drained and n1.reason == "slurmft: external_site: ERROR: site check: /scratch read-only"
    report = json.loads((config.parent / "reports" / "n1.json").read_text())
    assert report["acted"] == "drained" and report["decision"]["action"] == "drain"

    flag.write_text("0")
    res = sweep(slurm_cluster, config, "n1")
    assert res.returncode == 0, res.stderr
    assert not client.nodes()["n1"].drained
    assert "slurmft_sweep_node_healthy{node=\"n1\"} 1.0" in (config.parent / "textfile" / "slurmft_sweep_n1.prom").read_text()


@pytest.mark.timeout(120)
def test_other_drains_and_down_nodes_are_never_touched(slurm_cluster, site):
    config, flag = site
    client = CliSlurmClient(env=slurm_cluster.env)
    client.drain("n2", "maintenance: bad DIMM")
    scontrol(slurm_cluster, "update", "NodeName=n3", "State=DOWN", "Reason=dead PSU")
    for code in ("1", "0"):
        flag.write_text(code)
        for node in ("n2", "n3"):
            res = sweep(slurm_cluster, config, node)
            assert res.returncode == int(code), res.stderr
    nodes = client.nodes()
    assert nodes["n2"].drained and nodes["n2"].reason == "maintenance: bad DIMM"
    assert nodes["n3"].down and nodes["n3"].reason == "dead PSU"


@pytest.mark.timeout(120)
def test_blast_radius_guard_stops_the_next_drain(slurm_cluster, site):
    config, flag = site
    client = CliSlurmClient(env=slurm_cluster.env)
    flag.write_text("1")
    assert sweep(slurm_cluster, config, "n1").returncode == 1
    res = sweep(slurm_cluster, config, "n2", "--json")  # 10 % of 4 nodes, at least 1: n2 is one too many
    assert res.returncode == 1, res.stderr
    report = json.loads(res.stdout)
    assert report["decision"]["action"] == "blocked" and report["acted"] == ""
    assert "blast-radius guard: 1 of 4 nodes already drained by slurmft, at most 1 allowed" in report["decision"]["why"]
    assert not client.nodes()["n2"].drained
    prom = (config.parent / "textfile" / "slurmft_sweep_n2.prom").read_text()
    assert 'slurmft_sweep_blast_radius_blocked{node="n2"} 1.0' in prom


@pytest.mark.timeout(120)
def test_dry_run_acts_on_nothing(slurm_cluster, site):
    config, flag = site
    flag.write_text("1")
    res = sweep(slurm_cluster, config, "n4", "--dry-run")
    assert res.returncode == 1 and "decision: drain" in res.stdout and "nothing (dry run)" in res.stdout
    assert not CliSlurmClient(env=slurm_cluster.env).nodes()["n4"].drained


@pytest.mark.timeout(120)
def test_overlapping_cron_runs_do_not_both_act(slurm_cluster, site, tmp_path):
    config, flag = site
    flag.write_text("1")
    Path(f"{flag}.sleep").write_text("3")  # the check takes 3 s: the second run starts meanwhile
    env = {**os.environ, **slurm_cluster.env, "SLURMFT_CONFIG": str(config), "SLURMFT_BIN": str(SLURMFT),
           "SLURMFT_SWEEP_LOCK": str(tmp_path / "cron.lock")}
    first = subprocess.Popen([str(CRON), "--node", "n1"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(1.0)
    second = subprocess.run([str(CRON), "--node", "n1"], env=env, text=True, capture_output=True, timeout=60)
    out, err = first.communicate(timeout=90)
    assert second.returncode == 3 and "previous sweep still running" in second.stderr
    assert first.returncode == 1, err
    assert "acted=drained" in err
    assert CliSlurmClient(env=slurm_cluster.env).nodes()["n1"].drained


@pytest.mark.timeout(120)
def test_healthcheck_program_entry_point_finishes_well_inside_slurms_limit(slurm_cluster, site):
    config, flag = site
    env = {**os.environ, **slurm_cluster.env, "SLURMFT_CONFIG": str(config), "SLURMFT_BIN": str(SLURMFT),
           "SLURMD_NODENAME": "n2"}
    start = time.monotonic()
    # 60 s: slurmd's own limit for a HealthCheckProgram (past it, slurmd kills it). How far inside
    # it a sweep ends is benchmarks/sweep_bench.py's figure; here it is printed.
    res = subprocess.run([str(REPO / "bin" / "slurmft-healthcheck")], env=env, text=True,
                         capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "node=n2 status=ok action=none" in res.stderr
    print(f"slurmft-healthcheck took {time.monotonic() - start:.1f} s")


@pytest.mark.timeout(150)
def test_real_slurmd_runs_the_healthcheck_program_and_it_drains(devcluster, tmp_path):
    """Slurm's own HealthCheckProgram loop, on a second 2-node cluster of this test's own (its
    slurm.conf gets HealthCheckProgram; the shared session cluster is left as it is)."""
    from slurmft.slurm.devcluster import DevCluster

    wrapper = tmp_path / "hc-wrapper"
    config = tmp_path / "slurmft.toml"
    # Its own cluster in a short dir: slurmstepd's sockets lie under it (sun_path: 108 bytes).
    short = Path(tempfile.mkdtemp(prefix="hc", dir="/tmp"))
    cluster = DevCluster.up(short / "cluster", nodes=2)
    try:
        conf = Path(cluster.env["SLURM_CONF"])
        # slurmd gives the program SLURMD_NODENAME only; this cluster's config is not the default one
        wrapper.write_text(f"#!/bin/sh\nexport SLURM_CONF={conf} SLURMFT_CONFIG={config} SLURMFT_BIN={SLURMFT}\n"
                           f"exec {REPO / 'bin' / 'slurmft-healthcheck'} >> {tmp_path}/hc.log 2>&1\n")
        wrapper.chmod(0o755)
        config.write_text(f"""
[sweep]
checks = ["external_site"]
state_dir = "{tmp_path}/state"
report_dir = "{tmp_path}/reports"
textfile_dir = "{tmp_path}/textfile"
[[health_external.commands]]
name = "site"
argv = ["/bin/sh", "-c", "[ \\"$SLURMD_NODENAME\\" != n2 ] || {{ echo 'ERROR: GPU 3 missing'; exit 1; }}"]
""")
        with conf.open("a") as fh:
            fh.write(f"HealthCheckProgram={wrapper}\nHealthCheckInterval=5\nHealthCheckNodeState=ANY\n")
        scontrol(cluster, "reconfigure")
        client = CliSlurmClient(env=cluster.env)
        deadline = time.monotonic() + 60
        n1_report = tmp_path / "reports" / "n1.json"
        # each slurmd runs the program on its own clock: n2's drain says nothing of n1's run (s9c's
        # fresh run read n1's report the moment n2 drained: not written yet)
        while time.monotonic() < deadline and not (client.nodes()["n2"].drained
                                                    and n1_report.exists()):
            time.sleep(1)
        nodes = client.nodes()
        assert nodes["n2"].drained and nodes["n2"].reason == "slurmft: external_site: ERROR: GPU 3 missing"
        assert not nodes["n1"].drained
        assert n1_report.exists(), f"no report from n1 in 60 s: {sorted(os.listdir(tmp_path))}"
        assert json.loads(n1_report.read_text())["status"] == "ok"
    finally:
        cluster.down()
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.timeout(150)
def test_an_unreadable_state_never_lifts_an_xid_drain(slurm_cluster, tmp_path):
    """Issue 26 item 3 on the real controller: Xid 79 drains n3; the kernel log rotates (only the
    sweep's memory still has the Xid); the state file is damaged; the next sweeps keep the
    drain and say why, until the admin runs --forget-xids."""
    log = tmp_path / "kern.log"
    log.write_text("[6781741.548779] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, "
                   "GPU has fallen off the bus.\n")
    config = tmp_path / "slurmft.toml"
    config.write_text(f"""
[sweep]
checks = ["gpu_xid"]
state_dir = "{tmp_path}/state"
report_dir = "{tmp_path}/reports"
textfile_dir = "{tmp_path}/textfile"
[health_xid]
source = "file"
path = "{log}"
""")
    client = CliSlurmClient(env=slurm_cluster.env)
    res = sweep(slurm_cluster, config, "n3")
    assert res.returncode == 1, res.stderr
    assert client.nodes()["n3"].reason.startswith("slurmft: gpu_xid: Xid 79 on 0000:91:00")
    log.unlink()
    log.write_text("[6781800.0] usb 1-1: new high-speed USB device number 3\n")

    state = tmp_path / "state" / "health-n3.json"
    torn = state.read_bytes()[:60]  # what a disk fault leaves: the first bytes of the record
    state.write_bytes(torn)
    for first in (True, False):  # the first finds the damage, the second reads the loss it recorded
        res = sweep(slurm_cluster, config, "n3", "--json")
        assert res.returncode == 1, res.stderr
        report = json.loads(res.stdout)
        assert report["decision"]["action"] == "keep" and report["acted"] == ""
        assert "memory of this node was lost" in report["decision"]["why"]
        assert "(state file unreadable: " in report["decision"]["why"]
        assert client.nodes()["n3"].drained
        assert bool(report["notes"]) == first and (f"note: state file {state} unreadable" in res.stderr) == first
    assert (tmp_path / "state" / "health-n3.json.unreadable").read_bytes() == torn

    res = sweep(slurm_cluster, config, "n3", "--forget-xids")
    assert res.returncode == 0, res.stderr
    assert not client.nodes()["n3"].drained


@pytest.mark.timeout(120)
def test_a_check_that_leaves_a_setsid_child_is_judged_at_its_exit(slurm_cluster, tmp_path):
    """Issue 26 item 4 through the real sweep and controller: a site check exits 0 at once but
    leaves a child in a session of its own holding its stdout. The sweep judges the check by its
    exit (healthy: n2 stays in service), and the child does not outlive the sweep."""
    pid = tmp_path / "child.pid"
    config = tmp_path / "slurmft.toml"
    config.write_text(f"""
[sweep]
checks = ["external_site"]
state_dir = "{tmp_path}/state"
report_dir = "{tmp_path}/reports"
textfile_dir = "{tmp_path}/textfile"
[[health_external.commands]]
name = "site"
argv = ["/bin/sh", "-c", "setsid sh -c 'echo $$ > {pid}; exec sleep 300' & while [ ! -s {pid} ]; do sleep 0.01; done; echo all fine"]
timeout_s = 15
""")
    res = sweep(slurm_cluster, config, "n2", "--json")
    assert res.returncode == 0, res.stdout + res.stderr  # not "timed out after 15 s" and drained
    report = json.loads(res.stdout)
    assert {"check": "external_site", "status": "ok", "detail": "all fine"} in report["results"]
    assert not CliSlurmClient(env=slurm_cluster.env).nodes()["n2"].drained
    child = Path(f"/proc/{pid.read_text().strip()}")
    assert not child.exists() or child.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.timeout(180)
def test_the_sweep_benchmark_times_both_ways_in_against_the_cluster(slurm_cluster, tmp_path):
    """benchmarks/sweep_bench.py with ``--slurm-conf``: the in-process rows, and a dry-run sweep of
    a real node through the CLI and through the pre-flight's module, each with its CPU time. This
    checks the benchmark runs (and that both ways in sweep a live cluster's node), not its numbers."""
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sweep_bench.py"), "--runs", "1",
                          "--slurm-conf", slurm_cluster.env["SLURM_CONF"], "--node", "n2", "--json",
                          "--checks", "node_disk"],   # one check: not the host GPUs or kernel log
                         capture_output=True, text=True, timeout=150, cwd=REPO,
                         env={**os.environ, **slurm_cluster.env, "TMPDIR": str(tmp_path)})
    assert res.returncode in (0, 1), res.stderr[-2000:]   # 1: a median over its budget (a loaded box)
    rows = json.loads(res.stdout)["rows"]
    assert [(r["run"], r["mode"]) for r in rows] == [
        ("in-process", "normal"), ("in-process", "quick"), ("cli+slurm", "normal"), ("cli+slurm", "quick"),
        ("module+slurm", "normal"), ("module+slurm", "quick")]
    for r in rows[2:]:
        assert r["runs"] == 1 and r["median_s"] > 0 and r["cpu_median_s"] > 0, r
    assert list(tmp_path.glob("sweep-bench-*")) == []
