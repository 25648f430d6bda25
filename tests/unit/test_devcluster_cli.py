"""`slurmft devcluster` refuses bad input with one line and starts nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from slurmft.cli import app
from slurmft.slurm.devcluster import cluster, release


def run(*args: str):
    return CliRunner().invoke(app, ["devcluster", *args])


@pytest.mark.parametrize("nodes", ["0", "65"])
def test_node_count_out_of_range(tmp_path: Path, nodes: str) -> None:
    result = run("up", "--nodes", nodes, "--dir", str(tmp_path / "d"))
    assert result.exit_code == 1
    assert result.output == f"slurmft devcluster: --nodes {nodes}: must be between 1 and 64\n"
    assert not (tmp_path / "d").exists()


def test_not_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    result = run("up", "--dir", str(tmp_path / "d"))
    assert result.exit_code == 1
    assert result.output.startswith("slurmft devcluster: devcluster needs root")
    assert not (tmp_path / "d").exists()


def test_missing_binaries_name_the_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(release.shutil, "which", lambda name, path=None: None)
    result = run("up", "--dir", str(tmp_path / "d"))
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and "missing program(s): slurmctld, slurmd, slurmdbd, munged" in line
    assert line.endswith("apt-get install slurm-wlm slurmdbd munge mariadb-server (or: make install)")
    assert not (tmp_path / "d").exists()


def test_bad_daemon_env(tmp_path: Path) -> None:
    result = run("up", "--daemon-env", "oops", "--dir", str(tmp_path / "d"))
    assert result.exit_code == 1
    assert result.output == "slurmft devcluster: daemon environment entry 'oops' is not KEY=VALUE\n"


def test_env_and_down_without_a_cluster(tmp_path: Path) -> None:
    for command in ("env", "down", "status"):
        result = run(command, "--dir", str(tmp_path))
        assert result.exit_code == 1
        assert result.output == (f"slurmft devcluster: no devcluster in {tmp_path} "
                                 "(devcluster.json not found)\n")


@pytest.mark.parametrize("name, message", [
    ("with space", "must not contain spaces, quotes, '#' or '='"),
    ("x" * 90, "too long, socket paths under it would exceed 107 bytes"),
])
def test_unusable_dir(tmp_path: Path, name: str, message: str) -> None:
    result = run("up", "--dir", str(tmp_path / name))
    assert result.exit_code == 1
    assert result.output.startswith(f"slurmft devcluster: --dir {tmp_path / name}: {message}")
    assert not (tmp_path / name).exists()


def test_bad_daemon_env_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMFT_DEVCLUSTER_DAEMON_ENV", "LD_LIBRARY_PATH=/x =y")
    result = run("up", "--dir", str(tmp_path / "d"))
    assert result.exit_code == 1
    assert result.output == "slurmft devcluster: daemon environment entry '=y' is not KEY=VALUE\n"
    assert not (tmp_path / "d").exists()


def test_a_dir_whose_step_sockets_would_not_fit_is_refused() -> None:
    """slurmstepd's socket, <dir>/spool/<node>/<node>_<job>.4294967291, is the longest: a dir
    whose munge and MariaDB sockets fit but whose step sockets do not made every launch fail
    ("Unix socket path ... is too long"), Slurm hold the job, and the demo wait in vain (it ran
    under an xdist worker's longer tmp dir). Refused at once, before anything is made."""
    from slurmft.slurm.devcluster.cluster import DevClusterError, check_dir
    from slurmft.slurm.devcluster.layout import Layout

    root = Path("/tmp/" + "d" * 75)  # 80 bytes: munge's socket 102, MariaDB's 98, a step's 110
    assert len(str(root)) == 80
    with pytest.raises(DevClusterError, match="too long, socket paths under it would exceed 107"):
        check_dir(Layout(root), ["n1"])
    check_dir(Layout(Path("/tmp/" + "d" * 70)), ["n1"])  # 75 bytes: a step's socket is 105
