"""The devcluster against real Slurm daemons: the CLI life cycle (beside the session cluster,
so two clusters coexist), real accounting, and a real node death through ``kill_node``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmft.rundir import read_json
from slurmft.slurm.devcluster import DevCluster, DevClusterError
from slurmft.slurm.devcluster.daemons import NODE_MARK_ENV
from slurmft.slurm.devcluster.hosts import HOSTS_FILE, parse_blocks
from slurmft.slurm.devcluster.nodeprocs import node_processes
from slurmft.slurm.devcluster import daemons
from slurmft.slurm.devcluster.procs import ProcId, is_alive, read_environ, snapshot, wait_gone

pytestmark = pytest.mark.integration


def cli(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurmft.cli", "devcluster", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def slurm(env: dict[str, str], *argv: str, timeout: float = 60) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env}, check=False)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


def exports_to_env(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        assert line.startswith("export "), line
        key, _, value = line[len("export "):].partition("=")
        env[key] = value
    return env


def processes_mentioning(cluster_dir: Path, cluster_name: str) -> list[int]:
    """Live processes whose command line names the cluster dir or that carry its node mark."""
    found = []
    for st in snapshot():
        if st.state == "Z" or st.pid == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{st.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        mark = read_environ(st.pid).get(NODE_MARK_ENV, "")
        if str(cluster_dir) in cmdline or mark.startswith(f"{cluster_name}:"):
            found.append(st.pid)
    return found


@pytest.mark.timeout(200)
def test_cli_lifecycle_beside_session_cluster(devcluster: DevCluster, tmp_path: Path) -> None:
    cdir = tmp_path / "dc"
    started = cli("up", "--nodes", "2", "--dir", str(cdir))
    try:
        assert started.returncode == 0, started.stderr
        env = exports_to_env(started.stdout)
        assert env == {"SLURM_CONF": str(cdir / "slurm.conf")}
        state = read_json(cdir / "devcluster.json")
        assert state["cluster_name"] != devcluster.cluster_name
        assert set(state["ports"]["nodes"]) == {"n1", "n2"}

        nodes = slurm(env, "sinfo", "-h", "-N", "-o", "%N %T").split()
        assert nodes == ["n1", "idle", "n2", "idle"]
        job_id = slurm(env, "sbatch", "--parsable", "--wait", "-N", "2",
                       f"--output={cdir}/job-%j.out", "--wrap", "srun hostname").strip()
        assert (cdir / f"job-{job_id}.out").read_text().splitlines() == [os.uname().nodename] * 2
        deadline = time.monotonic() + 20  # slurmctld hands records to slurmdbd asynchronously
        while True:
            acct = slurm(env, "sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,ExitCode")
            if acct.strip() == "COMPLETED|0:0" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert acct.strip() == "COMPLETED|0:0"
        # The session cluster does not see this job: they really are two clusters.
        assert job_id not in slurm(devcluster.env, "squeue", "-h", "-o", "%i").split()

        again = cli("env", "--dir", str(cdir))
        assert again.returncode == 0 and exports_to_env(again.stdout) == env
        status = cli("status", "--dir", str(cdir))
        assert status.returncode == 0 and "n2" in status.stdout, status.stderr
        twice = cli("up", "--nodes", "2", "--dir", str(cdir))
        assert twice.returncode == 1
        assert twice.stderr.strip().splitlines() == [
            f"slurmft devcluster: {cdir} already holds a running devcluster "
            f"({state['cluster_name']}); run `slurmft devcluster down --dir {cdir}` first"]

        procs = [ProcId.from_json(p) for p in state["processes"].values()]
        assert len(procs) == 6 and all(is_alive(p) for p in procs)
        _, blocks = parse_blocks(HOSTS_FILE.read_text())
        assert state["cluster_name"] in {b.cluster for b in blocks}
        stopped = cli("down", "--dir", str(cdir))
        assert stopped.returncode == 0, stopped.stderr
    finally:
        if (cdir / "devcluster.json").exists():
            try:
                DevCluster.attach(cdir).down()
            except DevClusterError:
                pass
    assert not any(is_alive(p) for p in procs)
    assert processes_mentioning(cdir, state["cluster_name"]) == []
    _, blocks = parse_blocks(HOSTS_FILE.read_text())
    names = {b.cluster for b in blocks}
    assert state["cluster_name"] not in names and devcluster.cluster_name in names
    assert not (cdir / "devcluster.json").exists() and (cdir / "log" / "slurmctld.log").exists()
    devcluster.wait_nodes_idle(10)  # the session cluster is untouched


@pytest.mark.timeout(120)
def test_kill_node_is_a_real_node_death(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    env = slurm_cluster.env
    job_id = slurm(env, "sbatch", "--parsable", "-N", "1", "-w", "n2", f"--output={tmp_path}/o",
                   "--wrap", "srun sleep 300").strip()
    deadline = time.monotonic() + 20
    mark = slurm_cluster.processes()["slurmd-n2"]
    while True:  # batch step + srun + step 0's slurmstepd + sleep
        procs = node_processes(slurm_cluster.cluster_name, "n2", mark, NODE_MARK_ENV)
        if any(b"sleep" in Path(f"/proc/{p.pid}/cmdline").read_bytes() for p in procs
               if is_alive(p)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(procs) >= 4, procs

    slurm_cluster.kill_node("n2")
    assert not any(is_alive(p) for p in procs)
    assert node_processes(slurm_cluster.cluster_name, "n2", mark, NODE_MARK_ENV) == []
    assert not slurm_cluster.node_alive("n2")
    others = {n: slurm_cluster.node_alive(n) for n in ("n1", "n3", "n4")}
    assert others == {"n1": True, "n3": True, "n4": True}

    # The controller notices on its own (SlurmdTimeout=10): NOT_RESPONDING after ~15 s.
    deadline = time.monotonic() + 40
    while "NOT_RESPONDING" not in slurm_cluster.nodes()["n2"].flags:
        assert time.monotonic() < deadline, slurm_cluster.nodes()["n2"]
        time.sleep(0.5)

    slurm_cluster.start_node("n2")
    assert slurm_cluster.node_alive("n2")
    assert "NOT_RESPONDING" not in slurm_cluster.nodes()["n2"].flags
    slurm_cluster.reset()
    assert all(n.idle for n in slurm_cluster.nodes().values())
    assert job_id not in {j.job_id for j in slurm_cluster.jobs()}


@pytest.mark.timeout(60)
def test_reset_cleans_jobs_drains_and_dead_daemons(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    env = slurm_cluster.env
    slurm(env, "sbatch", "--parsable", "-N", "1", f"--output={tmp_path}/o", "--wrap", "sleep 300")
    slurm(env, "scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=test")
    assert "DRAIN" in slurm_cluster.nodes()["n3"].flags
    slurm_cluster.kill_node("n4")
    started = time.monotonic()
    slurm_cluster.reset()
    assert slurm_cluster.node_alive("n4")
    ctld = slurm_cluster.processes()["slurmctld"]
    os.kill(ctld.pid, signal.SIGKILL)
    assert wait_gone([ctld], 5) == []
    slurm_cluster.reset()  # restarts the controller from its saved state
    assert is_alive(slurm_cluster.processes()["slurmctld"])
    assert slurm_cluster.jobs() == []
    assert all(n.idle for n in slurm_cluster.nodes().values())
    # reset() of a clean cluster touches nothing (how long it takes is benchmarks/devcluster_bench.py's
    # reset_clean_s, not a test's business).
    before = slurm_cluster.processes()
    slurm_cluster.reset()
    assert slurm_cluster.processes() == before
    print(f"reset after a controller kill: {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(90)
def test_reset_after_controller_restart_with_a_drained_unregistered_node(
        slurm_cluster: DevCluster) -> None:
    """A controller restarted from saved state shows a drained node as UNKNOWN+DRAIN until its
    slurmd registers, and 22.05 answers RESUME there with "Invalid node state specified" (the
    cause of a flaky reset). reset() must wait for the node to register, not fail."""
    env = slurm_cluster.env
    slurm(env, "scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=test")
    slurm_cluster.kill_node("n3")  # its slurmd cannot register until reset() starts it again
    ctld = slurm_cluster.processes()["slurmctld"]
    slurm(env, "scontrol", "shutdown", "slurmctld")  # saves its state (n3 drained) and exits
    assert wait_gone([ctld], 20) == []
    slurm_cluster.reset()
    assert all(n.idle for n in slurm_cluster.nodes().values())
    assert slurm_cluster.node_alive("n3")


@pytest.mark.timeout(30)
def test_kill_unknown_node_is_refused(devcluster: DevCluster) -> None:
    with pytest.raises(DevClusterError, match="unknown node 'n9'; this cluster has n1, n2, n3, n4"):
        devcluster.kill_node("n9")


@pytest.mark.timeout(120)
def test_failed_up_stops_what_it_started(devcluster: DevCluster, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real_services = daemons.services
    bad_conf = tmp_path / "bad.conf"  # exists (a missing file makes slurmctld retry for 60 s)
    bad_conf.write_text("NoSuchOption=1\n")

    def broken_controller(*args, **kwargs):
        found = real_services(*args, **kwargs)
        ctld = found[-1]
        assert ctld.name == "slurmctld"
        bad = daemons.Service(ctld.name, [ctld.argv[0], "-D", "-f", str(bad_conf)],
                              ctld.ready, ctld.what, ctld.logs)
        return [*found[:-1], bad]

    monkeypatch.setattr(daemons, "services", broken_controller)
    cdir = tmp_path / "dc"
    with pytest.raises(daemons.DaemonFailed) as failure:
        DevCluster.up(cdir, nodes=1)
    lines = str(failure.value).splitlines()
    assert lines[0] == "slurmctld exited before listening on port " + lines[0].rsplit(" ", 1)[-1]
    assert any("NoSuchOption" in line for line in lines[1:]), lines  # the log tail says why
    assert not (cdir / "devcluster.json").exists()
    assert processes_mentioning(cdir, "sft-none") == []
    _, blocks = parse_blocks(HOSTS_FILE.read_text())
    directories = {b.directory for b in blocks}
    assert str(cdir) not in directories and str(devcluster.dir) in directories


@pytest.mark.timeout(120)
def test_up_over_a_crashed_cluster_and_down_of_a_dead_one(devcluster: DevCluster,
                                                          tmp_path: Path) -> None:
    cdir = tmp_path / "dc"
    first = DevCluster.up(cdir, nodes=1, daemon_env={"SLURMFT_TEST_EXTRA": "yes"})
    try:
        assert read_environ(first.processes()["slurmdbd"].pid)["SLURMFT_TEST_EXTRA"] == "yes"
        for proc in first.processes().values():  # a crash: every daemon killed, no `down`
            os.kill(proc.pid, signal.SIGKILL)
        assert wait_gone(first.processes().values(), 10) == []
        second = DevCluster.up(cdir, nodes=1)
        assert second.cluster_name != first.cluster_name
        _, blocks = parse_blocks(HOSTS_FILE.read_text())
        assert first.cluster_name not in {b.cluster for b in blocks}
        for proc in second.processes().values():
            os.kill(proc.pid, signal.SIGKILL)
        assert wait_gone(second.processes().values(), 10) == []
        with pytest.raises(DevClusterError, match="is not running"):
            DevCluster.attach(cdir)
        stopped = cli("down", "--dir", str(cdir))
        assert stopped.returncode == 0, stopped.stderr
        assert "was not running; cleaned up" in stopped.stderr
        assert not (cdir / "devcluster.json").exists()
        _, blocks = parse_blocks(HOSTS_FILE.read_text())
        assert second.cluster_name not in {b.cluster for b in blocks}
    finally:
        if (cdir / "devcluster.json").exists():
            DevCluster.attach(cdir, running=False).down()
