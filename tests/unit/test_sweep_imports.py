"""The sweeper runs on compute nodes and login nodes without torch: importing it never loads torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_sweep_and_health_never_import_torch():
    code = ("import sys, slurmft.cli, slurmft.sweep.run, slurmft.health.registry, slurmft.commands.sweep; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# What ``python -m slurmft.cli ARGS...`` (the pre-flight's way in, launch/nodecheck.py) has
# imported when it exits, printed by an atexit hook (typer ends with sys.exit).
_MODULES_AT_EXIT = ("import atexit, runpy, sys\n"
                    "atexit.register(lambda: print('MODULES', *sorted(sys.modules), file=sys.stderr))\n"
                    "sys.argv = ['slurmft', *sys.argv[1:]]\n"
                    "runpy.run_module('slurmft.cli', run_name='__main__')\n")


def _modules_at_exit(*args: str) -> tuple[set[str], str]:
    done = subprocess.run([sys.executable, "-c", _MODULES_AT_EXIT, *args], capture_output=True,
                          text=True, timeout=60)
    [line] = [ln for ln in done.stderr.splitlines() if ln.startswith("MODULES ")]
    return set(line.split()[1:]), done.stdout


@pytest.mark.timeout(120)
def test_a_command_imports_only_its_own_module_and_help_lists_every_command():
    """The pre-flight runs ``slurmft sweep`` on every node of every job start: it imports the
    sweep command, not the checkpoint tools', the devcluster's or the others' (on the code before,
    all seven, the devcluster's included: half of its CPU)."""
    modules, _ = _modules_at_exit("sweep", "--help")
    commands = {m for m in modules if m.startswith("slurmft.commands.")}
    assert commands == {"slurmft.commands.sweep"}, commands
    assert not {m for m in modules if m.startswith("slurmft.slurm.devcluster")}
    modules, out = _modules_at_exit("--help")
    for name in ("ckpt", "devcluster", "interval", "launch", "status", "sweep", "watch"):
        assert f"slurmft.commands.{name}" in modules and f" {name} " in out, (name, out)


@pytest.mark.timeout(60)
def test_the_sweep_imports_prometheus_client_only_to_write_a_textfile():
    code = ("import sys, slurmft.commands.sweep, slurmft.sweep.run; "
            "sys.exit(1 if 'prometheus_client' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
