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
