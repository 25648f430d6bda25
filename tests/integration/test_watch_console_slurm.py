"""``slurmft watch JOBID`` in a terminal, on the real devcluster, without flags: a job that
crashed is found and requeued, and each of those events is printed as it happens (the command's
own wiring of ``slurmft/watch/console.py``, through a pseudo-terminal; the unit tests drive a whole
recovery: tests/unit/test_watch_console.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient

pytestmark = pytest.mark.integration


def _in_pty(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    primary, secondary = os.openpty()
    proc = subprocess.Popen(argv, stdout=secondary, stderr=secondary, stdin=subprocess.DEVNULL,
                            env=env, close_fds=True)
    os.close(secondary)
    out = b""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"{argv} did not end within {timeout} s: {out!r}"
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(primary)
    return proc.wait(timeout=30), out.decode(errors="replace")


@pytest.mark.timeout(300)
def test_watch_in_a_terminal_prints_the_crash_and_the_requeue(slurm_cluster, tmp_path):
    client = CliSlurmClient(env=slurm_cluster.env)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    script = tmp_path / "crash.sh"
    script.write_text("#!/bin/bash\nexit 3\n")
    job_id = client.submit(script, sbatch_options=[f"--output={tmp_path}/crash.out",
                                                   f"--comment=SLURMFT_RUN_DIR={run.root}"])
    try:
        deadline = time.monotonic() + 120
        while not client.job(job_id).state.finished:
            assert time.monotonic() < deadline, f"job {job_id} did not end within 120 s"
            time.sleep(0.5)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")
               and k != "JOURNAL_STREAM"}
        code, out = _in_pty([sys.executable, "-m", "slurmft.cli", "watch", job_id, "--once"],
                            {**env, **slurm_cluster.env, "TERM": "xterm", "COLUMNS": "200"}, 120)
        assert code == 0, out
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out).replace("\r", "")
        stamp = r"\d\d:\d\d:\d\d "
        assert re.search(stamp + f"job {job_id}: watching \\(run dir {run.root}\\)", text), text
        assert re.search(stamp + f"job {job_id}: fault: crash: the job FAILED with exit 3", text), text
        assert re.search(stamp + f"job {job_id}: requeue \\(crash\\)", text), text
        assert client.job(job_id).restart_count == 1  # what it printed, it did
    finally:
        client.cancel(job_id)
