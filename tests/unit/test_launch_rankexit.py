"""A rank's crash journaled by its node's warm server when it happens (``launch/rankexit.py``,
issue 27): real server and client processes (``launch/warm.py``), real signals and exits; the
launcher's side (``inplace``) is tests/unit/test_launch_inplace.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from slurmft import exitcodes, journal
from slurmft.launch import rankexit, warmclient, warmtask
from slurmft.rundir import RunDir

PY = sys.executable
CLIENT = [PY, "-I", "-S", warmclient.__file__, "--"]
WAIT_S = 120.0   # a loaded 2-core box: every liveness wait bounded generously

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    path = os.path.join(tempfile.mkdtemp(prefix="slurmft-rankexit-test-", dir="/tmp"), "s")
    proc = subprocess.Popen([PY, "-m", "slurmft.launch.warm", "--socket", path, "--imports", "json"],
                            stderr=subprocess.PIPE, text=True)
    yield path
    warmtask.stop_server(proc, path)


def _rank(server: str, tmp_path: Path, body: str, rank: int = 1) -> subprocess.Popen:
    script = tmp_path / f"rank{rank}.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, warmclient.SOCKET_ENV: server, "SLURMFT_RUN_DIR": str(tmp_path / "run"),
           "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2", "TORCHELASTIC_RESTART_COUNT": "3",
           "RANK": str(rank), "SLURMD_NODENAME": "n2"}
    # As torchrun starts a rank: its own session.
    return subprocess.Popen([*CLIENT, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _exits(tmp_path: Path) -> list:
    events = RunDir(tmp_path / "run").events
    return journal.read_events(events, [journal.RANK_EXIT]) if events.exists() else []


def test_a_warm_rank_killed_9_or_failing_is_journaled_by_its_server_when_it_ends(server, tmp_path):
    (tmp_path / "run").mkdir()
    killed = _rank(server, tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    killed.communicate(timeout=WAIT_S)
    assert killed.returncode == -signal.SIGKILL
    failed = _rank(server, tmp_path, "raise RuntimeError('boom')\n", rank=4)
    failed.communicate(timeout=WAIT_S)
    assert failed.returncode == 1
    deadline = time.monotonic() + WAIT_S
    while len(_exits(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    first, second = _exits(tmp_path)
    assert (first.get("job_id"), first.count("restart_count"), first.get("attempt"), first.get("rank"),
            first.get("node"), first.get("exit_code"), first.get("how")) == \
        ("7", 2, 3, 1, "n2", -signal.SIGKILL, "killed by SIGKILL")
    assert (second.get("rank"), second.get("exit_code"), second.get("how")) == (4, 1, "exit code 1")


def test_deliberate_ends_a_stop_and_a_kill_after_the_clients_death_are_not_crashes(server, tmp_path):
    (tmp_path / "run").mkdir()
    for code in (exitcodes.OK, exitcodes.REQUEUE, exitcodes.REFORM):
        proc = _rank(server, tmp_path, f"import os\nos._exit({code})\n")
        proc.communicate(timeout=WAIT_S)
        assert proc.returncode == code
    ready = tmp_path / "ready"
    body = f"import time\nopen({str(ready)!r}, 'w').close()\ntime.sleep(600)\n"
    stopped = _rank(server, tmp_path, body)
    deadline = time.monotonic() + WAIT_S
    while not ready.exists():
        assert time.monotonic() < deadline, "the rank did not start"
        time.sleep(0.05)
    os.killpg(stopped.pid, signal.SIGTERM)           # torchrun's stop of its workers
    stopped.communicate(timeout=WAIT_S)
    assert stopped.returncode == -signal.SIGTERM
    ready.unlink()
    orphan = _rank(server, tmp_path, body)
    while not ready.exists():
        assert time.monotonic() < deadline, "the rank did not start"
        time.sleep(0.05)
    orphan.kill()                                    # torchrun's KILL of a client that lingered
    orphan.wait(timeout=WAIT_S)
    time.sleep(1.0)  # the server reaped the worker it killed by now (its loop polls every 0.2 s)
    assert _exits(tmp_path) == []


@pytest.mark.parametrize("code, crash", [(0, False), (85, False), (86, False), (87, False), (88, False),
                                         (1, True), (2, True), (-signal.SIGTERM, False),
                                         (-signal.SIGINT, False), (-signal.SIGKILL, True),
                                         (-signal.SIGSEGV, True), (-signal.SIGABRT, True)])
def test_what_counts_as_a_crash(code, crash):
    assert rankexit.crashed(code) is crash


def test_outside_a_run_or_when_the_journal_cannot_be_written_nothing_breaks(tmp_path):
    said: list[str] = []
    assert rankexit.record({"SLURM_JOB_ID": "7"}, -9, 1, said.append) is False  # no run dir
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").mkdir()      # not a file: cannot be appended to
    env = {"SLURMFT_RUN_DIR": str(tmp_path / "run"), "SLURM_JOB_ID": "7", "RANK": "x"}
    assert rankexit.record(env, -9, 1, said.append) is False
    assert len(said) == 1 and "could not journal rank -1's crash (killed by SIGKILL)" in said[0]
