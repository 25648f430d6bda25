"""The sweeper runs on compute nodes and login nodes without torch: importing it never loads torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_sweep_and_health_never_import_torch():
    code = ("import sys, slurmft.cli, slurmft.sweep.run, slurmft.health.registry, slurmft.commands.sweep; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# What ``python -m MODULE ARGS...`` has imported when it exits, printed by an atexit hook (typer
# ends with sys.exit).
_MODULES_AT_EXIT = ("import atexit, runpy, sys\n"
                    "atexit.register(lambda: print('MODULES', *sorted(sys.modules), file=sys.stderr))\n"
                    "module = sys.argv[1]\n"
                    "sys.argv = ['slurmft', *sys.argv[2:]]\n"
                    "runpy.run_module(module, run_name='__main__')\n")


def _modules_at_exit(*args: str, module: str = "slurmft.cli",
                     env: dict[str, str] | None = None) -> tuple[set[str], str, int]:
    done = subprocess.run([sys.executable, "-c", _MODULES_AT_EXIT, module, *args], capture_output=True,
                          text=True, timeout=60, env=env, cwd=REPO)
    [line] = [ln for ln in done.stderr.splitlines() if ln.startswith("MODULES ")]
    return set(line.split()[1:]), done.stdout, done.returncode


@pytest.mark.timeout(120)
def test_a_command_imports_only_its_own_module_and_help_lists_every_command():
    """``slurmft sweep`` (cron, HealthCheckProgram) imports the sweep command, not the checkpoint
    tools', the devcluster's or the others' (on the code before, all seven, the devcluster's
    included: half of its CPU)."""
    modules, _, _ = _modules_at_exit("sweep", "--help")
    commands = {m for m in modules if m.startswith("slurmft.commands.")}
    assert commands == {"slurmft.commands.sweep"}, commands
    assert not {m for m in modules if m.startswith("slurmft.slurm.devcluster")}
    modules, out, _ = _modules_at_exit("--help")
    for name in ("ckpt", "devcluster", "interval", "launch", "status", "sweep", "watch"):
        assert f"slurmft.commands.{name}" in modules and f" {name} " in out, (name, out)


@pytest.mark.timeout(60)
def test_the_sweep_imports_prometheus_client_only_to_write_a_textfile():
    code = ("import sys, slurmft.commands.sweep, slurmft.sweep.run; "
            "sys.exit(1 if 'prometheus_client' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.timeout(60)
def test_the_preflights_sweep_runs_without_typer_pydantic_or_rich(tmp_path):
    """The pre-flight's sweep (``python -m slurmft.sweep.main``, on every node of every job start)
    sweeps and prints its JSON report without the CLI's libraries: typer coerced each option
    through pydantic: with typer and its click, ~0.17 CPU-s of the ~0.4 a quick dry-run sweep took
    (benchmarks/sweep_bench.py, 2026-11-29: 0.41 -> 0.22-0.25 CPU-s)."""
    config = tmp_path / "slurmft.toml"
    config.write_text(f'[sweep]\nstate_dir = "{tmp_path / "state"}"\nreport_dir = "{tmp_path / "reports"}"\n'
                      f'textfile_dir = "{tmp_path / "textfiles"}"\n[slurm]\nretries = 0\n')
    # No Slurm on PATH: the sweep gathers its facts, cannot read the nodes, reports that (exit 4).
    env = {"PATH": str(tmp_path / "no-such-dir"), "HOME": str(tmp_path), "SLURMFT_CONFIG": "",
           "PYTHONPATH": str(REPO)}
    modules, out, rc = _modules_at_exit("--quick", "--dry-run", "--json", "--node", "n1", "--config",
                                        str(config), module="slurmft.sweep.main", env=env)
    assert rc == 4, out   # a Slurm call failed
    report = json.loads(out)
    assert report["node"] == "n1" and report["mode"] == "quick" and report["dry_run"] is True
    assert "could not read nodes" in report["error"]
    loaded = {m.split(".")[0] for m in modules} & {"typer", "click", "pydantic", "rich", "torch"}
    assert not loaded, loaded
