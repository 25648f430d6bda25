"""deploy/systemd: slurmft-watch.service (the documented deployment: one watcher per user,
`slurmft watch --user %u --all`) and slurmft-watch@.service (one job): each restarts the watcher
only on the exits that a restart can fix (the watch command's own exit codes), and is a unit
systemd itself accepts without a complaint (``systemd-analyze verify``, where it is installed)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from slurmft.commands import watch

pytestmark = pytest.mark.timeout(60)

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "slurmft-watch@.service"
USER_UNIT = UNIT.with_name("slurmft-watch.service")


def _unit(path: Path = UNIT) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(path.read_text())
    return parser


def test_the_per_user_unit_watches_every_job_of_its_user_with_one_watcher():
    unit = _unit(USER_UNIT)
    service = unit["Service"]
    argv = service["ExecStart"].split()
    assert argv[0].startswith("%h/") and argv[0].endswith("/slurmft")
    assert argv[1:5] == ["watch", "--user", "%u", "--all"]  # %u: the user manager's own user
    assert service["Restart"] == "on-failure"
    prevent = {int(code) for code in service["RestartPreventExitStatus"].split()}
    assert prevent == {watch.EXIT_USAGE}
    assert watch.EXIT_SLURM not in prevent
    assert unit["Install"]["WantedBy"] == "default.target"


def test_it_watches_the_instance_and_restarts_only_what_a_restart_can_fix():
    service = _unit()["Service"]
    argv = service["ExecStart"].split()
    assert argv[0].startswith("%h/") and argv[0].endswith("/slurmft")
    assert argv[1:3] == ["watch", "%i"]
    assert service["Restart"] == "on-failure"
    prevent = {int(code) for code in service["RestartPreventExitStatus"].split()}
    assert prevent == {watch.EXIT_USAGE, watch.EXIT_LOCKED}
    assert watch.EXIT_SLURM not in prevent  # Slurm unreachable at start: try again later
    assert _unit()["Install"]["WantedBy"] == "default.target"  # a --user unit


def test_the_environment_the_unit_sets_is_one_the_watcher_accepts(tmp_path, monkeypatch):
    """Every Environment= variable of the unit reaches `slurmft watch`: one named like a
    [watch] setting (SLURMFT_WATCH_*) must be one, or the watcher refuses to start (exit 2)."""
    from slurmft.config import load_section
    from slurmft.watch.config import WatchConfig

    monkeypatch.chdir(tmp_path)  # no slurmft.toml of the checkout's
    for line in _unit()["Service"]["Environment"].splitlines():
        key, _, value = line.strip().partition("=")
        monkeypatch.setenv(key, value)
    load_section(WatchConfig, "watch")  # raises ConfigError naming the variable


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_accepts_the_per_user_unit_without_a_warning(tmp_path):
    home = tmp_path / "home"
    exe = home / ".local" / "bin" / "slurmft"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    shutil.copy(USER_UNIT, units / USER_UNIT.name)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", USER_UNIT.name], cwd=units,
                          env={**os.environ, "HOME": str(home)}, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_accepts_the_unit_without_a_warning(tmp_path):
    home = tmp_path / "home"
    exe = home / ".local" / "bin" / "slurmft"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    shutil.copy(UNIT, units / UNIT.name)
    (units / "slurmft-watch@123.service").symlink_to(UNIT.name)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", "slurmft-watch@123.service"],
                          cwd=units, env={**os.environ, "HOME": str(home)}, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
