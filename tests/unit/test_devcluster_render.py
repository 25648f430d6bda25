"""slurm.conf / slurmdbd.conf / bootstrap SQL text of the devcluster."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from slurmft.slurm.devcluster.layout import Layout
from slurmft.slurm.devcluster.ports import ports_from_base
from slurmft.slurm.devcluster.render import (
    ConfSpec, render_db_bootstrap_sql, render_slurm_conf, render_slurmdbd_conf,
)


def conf_lines(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if not line.startswith(("NodeName", "PartitionName")))


@pytest.fixture
def spec(tmp_path: Path) -> ConfSpec:
    names = ["n1", "n2", "n3"]
    return ConfSpec(layout=Layout(tmp_path), cluster_name="sftdeadbeef", node_names=names,
                    ports=ports_from_base(25000, names), cpus_per_node=2, memory_mb_per_node=1000,
                    db_password="abc123")


def test_slurm_conf_points_every_path_and_port_into_the_cluster(spec: ConfSpec, tmp_path: Path) -> None:
    text = render_slurm_conf(spec)
    kv = conf_lines(text)
    assert kv["ClusterName"] == "sftdeadbeef"
    assert kv["SlurmctldPort"] == "25000" and kv["SlurmdPort"] == "25001"
    assert kv["AccountingStoragePort"] == "25002"
    munge = str(tmp_path / "munge" / "munge.socket.2")
    # Without AccountingStoragePass=<munge socket>, slurmctld 22.05 exits at start.
    assert kv["AuthInfo"] == f"socket={munge}" and kv["AccountingStoragePass"] == munge
    assert kv["ProctrackType"] == "proctrack/linuxproc" and kv["TaskPlugin"] == "task/none"
    assert kv["StateSaveLocation"] == str(tmp_path / "state")
    assert kv["SlurmdSpoolDir"] == f"{tmp_path}/spool/%n"
    assert "cgroup" not in text
    nodes = [line for line in text.splitlines() if line.startswith("NodeName=")]
    assert nodes == [
        f"NodeName=n{i} NodeHostname=localhost NodeAddr=127.0.0.1 Port={25003 + i} CPUs=2 "
        "RealMemory=1000 State=UNKNOWN" for i in (1, 2, 3)]
    assert text.splitlines()[-1] == ("PartitionName=debug Nodes=n1,n2,n3 Default=YES "
                                     "MaxTime=INFINITE State=UP")


def test_min_job_age_is_600_s_unless_asked_for_less(spec: ConfSpec) -> None:
    assert conf_lines(render_slurm_conf(spec))["MinJobAge"] == "600"
    short = replace(spec, min_job_age_s=5)
    assert "MinJobAge=5" in render_slurm_conf(short).splitlines()
    assert render_slurm_conf(short).count("MinJobAge=") == 1


def test_proctrack_pgid_on_request_and_nothing_the_devcluster_cannot_run(spec: ConfSpec) -> None:
    pgid = render_slurm_conf(replace(spec, proctrack="pgid")).splitlines()
    assert "ProctrackType=proctrack/pgid" in pgid and "ProctrackType=proctrack/linuxproc" not in pgid
    for value in ("cgroup", "proctrack/pgid", "pgid\nX=1", None):
        with pytest.raises(ValueError, match="proctrack .*must be one of linuxproc, pgid"):
            replace(spec, proctrack=value)


@pytest.mark.parametrize("value", [0, 1, -5, 86401, 5.0, "5", True, None])
def test_a_min_job_age_slurm_would_not_purge_after_is_refused(spec: ConfSpec, value) -> None:
    # 0 means "never purge" to Slurm and 1 is below what slurm.conf(5) recommends.
    with pytest.raises(ValueError, match="min_job_age_s"):
        replace(spec, min_job_age_s=value)


def test_devcluster_up_refuses_a_bad_min_job_age_before_starting_anything(tmp_path: Path) -> None:
    from slurmft.slurm.devcluster import DevCluster, DevClusterError

    with pytest.raises(DevClusterError, match="min_job_age_s 0"):
        DevCluster.up(tmp_path / "c", nodes=1, min_job_age_s=0)
    assert not (tmp_path / "c").exists()


def test_slurmd_timeout_is_10_s_unless_asked_for_more(spec: ConfSpec) -> None:
    assert conf_lines(render_slurm_conf(spec))["SlurmdTimeout"] == "10"
    assert "SlurmdTimeout=120" in render_slurm_conf(replace(spec, slurmd_timeout_s=120)).splitlines()


@pytest.mark.parametrize("value", [0, 4, 3601, 10.0, "10", True])
def test_a_slurmd_timeout_out_of_range_is_refused(spec: ConfSpec, value) -> None:
    with pytest.raises(ValueError, match="slurmd_timeout_s"):
        replace(spec, slurmd_timeout_s=value)


def test_a_prolog_is_named_only_when_asked_for(spec: ConfSpec, tmp_path: Path) -> None:
    assert "Prolog" not in conf_lines(render_slurm_conf(spec))
    prolog = tmp_path / "prolog"
    prolog.write_text("#!/bin/sh\nexit 0\n")
    prolog.chmod(0o755)
    assert f"Prolog={prolog}" in render_slurm_conf(replace(spec, prolog=str(prolog))).splitlines()


@pytest.mark.parametrize("value", ["relative/prolog", "/tmp/a b", "/tmp/x\nSlurmUser=nobody", "/nonexistent/prolog"])
def test_a_prolog_that_slurm_conf_cannot_name_or_run_is_refused(spec: ConfSpec, value) -> None:
    with pytest.raises(ValueError, match="prolog"):
        replace(spec, prolog=value)


def test_slurmdbd_conf_uses_the_private_mariadb(spec: ConfSpec, tmp_path: Path) -> None:
    kv = conf_lines(render_slurmdbd_conf(spec))
    assert kv["DbdPort"] == "25002" and kv["StoragePort"] == "25003"
    assert kv["StorageHost"] == "127.0.0.1" and kv["StoragePass"] == "abc123"
    assert kv["AuthInfo"] == f"socket={tmp_path}/munge/munge.socket.2"


def test_bootstrap_sql_creates_the_user_for_tcp_and_socket() -> None:
    sql = render_db_bootstrap_sql("abc123")
    assert "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'abc123'" in sql
    assert "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'" in sql


def test_bootstrap_sql_refuses_a_password_that_could_break_out_of_quotes() -> None:
    with pytest.raises(ValueError, match="alphanumeric"):
        render_db_bootstrap_sql("x'; DROP DATABASE mysql; --")


def test_a_cluster_may_have_several_partitions_the_first_the_default(spec: ConfSpec) -> None:
    from slurmft.slurm.devcluster.render import check_partitions

    parts = check_partitions({"train": ["n1", "n2"], "other": ["n3"]}, spec.node_names)
    lines = render_slurm_conf(replace(spec, partitions=parts)).splitlines()
    assert lines[-2:] == ["PartitionName=train Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP",
                          "PartitionName=other Nodes=n3 Default=NO MaxTime=INFINITE State=UP"]
    for bad, message in [({"x y": ["n1"]}, "partition name 'x y'"), ({"a": ["n9"]}, "partition a"),
                         ({"a": []}, "partition a"), ({}, "at least one partition")]:
        with pytest.raises(ValueError, match=message):
            check_partitions(bad, spec.node_names)
