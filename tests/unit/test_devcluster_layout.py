"""The devcluster state file and release helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.slurm.devcluster.errors import DevClusterError
from slurmft.slurm.devcluster.layout import ClusterState, Layout, load_state
from slurmft.slurm.devcluster.ports import ports_from_base
from slurmft.slurm.devcluster.procs import ProcId
from slurmft.slurm.devcluster.release import (
    daemon_env_from_pairs, mariadbd_release_args, parse_version, version_string,
)


def test_state_round_trip(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    state = ClusterState("sfta", ["n1", "n2"], ports_from_base(21000, ["n1", "n2"]), (24, 11, 5),
                         daemon_env={"LD_LIBRARY_PATH": "/x"},
                         processes={"slurmctld": ProcId(12, 34)}, hosts_names=["n1"], ready=True)
    state.save(layout)
    assert load_state(layout) == state


def test_missing_and_corrupt_state(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    with pytest.raises(DevClusterError, match=f"no devcluster in {tmp_path}"):
        load_state(layout)
    layout.state_file.write_text('{"version": 1}')
    with pytest.raises(DevClusterError, match="unreadable devcluster state"):
        load_state(layout)


@pytest.mark.parametrize("text, version", [
    ("slurm-wlm 22.05.8\n", (22, 5, 8)),
    ("slurm 24.11.5\n", (24, 11, 5)),
    ("mariadbd  Ver 11.8.3-MariaDB-1 for debian-linux-gnu", (11, 8, 3)),
])
def test_parse_version(text: str, version: tuple[int, int, int]) -> None:
    assert parse_version(text) == version


def test_version_string_and_unreadable_version() -> None:
    assert version_string((22, 5, 8)) == "22.05.8"
    with pytest.raises(DevClusterError, match="cannot read a version"):
        parse_version("slurm unknown")


def test_snapshot_isolation_is_switched_off_only_where_it_defaults_on() -> None:
    assert mariadbd_release_args((10, 11, 19)) == []
    assert mariadbd_release_args((11, 8, 3)) == ["--innodb-snapshot-isolation=OFF"]


def test_daemon_env_pairs() -> None:
    assert daemon_env_from_pairs(["LD_LIBRARY_PATH=/a:/b", "X="]) == {"LD_LIBRARY_PATH": "/a:/b", "X": ""}
    with pytest.raises(DevClusterError, match="'1X=2' is not KEY=VALUE"):
        daemon_env_from_pairs(["1X=2"])


def test_daemon_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmft.slurm.devcluster.cluster import DevCluster

    monkeypatch.setenv("SLURM_JOB_ID", "7")  # `up` run from inside another cluster's job
    monkeypatch.setenv("SLURMFT_DEVCLUSTER_NODE", "other:n1")
    state = ClusterState("sfta", ["n1"], ports_from_base(21000, ["n1"]), (22, 5, 8),
                         daemon_env={"LD_LIBRARY_PATH": "/opt/lib"})
    cluster = DevCluster(Layout(tmp_path), state, binaries=None)  # type: ignore[arg-type]
    env = cluster._daemon_env()
    assert env["LD_LIBRARY_PATH"] == "/opt/lib" and env["SLURM_CONF"] == str(tmp_path / "slurm.conf")
    assert "SLURM_JOB_ID" not in env and "SLURMFT_DEVCLUSTER_NODE" not in env
    assert cluster._daemon_env("n1")["SLURMFT_DEVCLUSTER_NODE"] == "sfta:n1"


def test_each_clusters_mariadb_has_its_own_tmpdir(tmp_path: Path, monkeypatch) -> None:
    # A mariadbd deletes the #sql* files it finds in its tmpdir when it starts: two clusters
    # sharing /tmp broke each other's install-db ("Error on delete of '/tmp/#sql-temptable-...'").
    from dataclasses import fields
    from types import SimpleNamespace

    from slurmft.slurm.devcluster import daemons
    from slurmft.slurm.devcluster.release import Binaries

    layout = Layout(tmp_path / "c")
    layout.make_dirs(["n1"])
    assert layout.mysql_tmpdir.is_dir() and layout.mysql_tmpdir.is_relative_to(layout.root)
    bins = Binaries(**{f.name: f"/usr/bin/{f.name}" for f in fields(Binaries)})
    assert f"--tmpdir={layout.mysql_tmpdir}" in daemons.mariadbd_argv(bins, layout, 3306, (10, 11, 6))
    seen: list[list[str]] = []
    monkeypatch.setattr(daemons.subprocess, "run",
                        lambda argv, **kw: seen.append(argv) or SimpleNamespace(returncode=0))
    daemons.install_mariadb(bins, layout, {})
    assert f"--tmpdir={layout.mysql_tmpdir}" in seen[0]
