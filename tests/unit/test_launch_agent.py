"""torchrun's agent as slurmft starts it (``python -m slurmft.launch.agent``, launch/agent.py):
real torchrun (standalone, one rank) on each ending the node task, the relay and the launcher act
on: the agent's exit status and report are torchrun's (the same as ``python -m
torch.distributed.run``'s: 0, or 1 with its report), its stdout and stderr are flushed, its
``atexit`` handlers run, and the interpreter's teardown of torch does not (``teardown_probe``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

import teardown_probe
from procs import alive, wait_until
from slurmft.launch import agent, ownedtmp

WAIT_S = 180.0   # a loaded 2-core box: torch's import alone takes seconds

RANK = """
import os, sys, time
with open(os.path.join(os.environ["PROBE_DIR"], "rank"), "w") as f:
    f.write(str(os.getpid()))
print("rank says hi", flush=True)
if sys.argv[1] == "sleep":
    time.sleep(300)
sys.exit(int(sys.argv[1]))
"""


def _start(tmp_path: Path, ending: str, *options: str) -> subprocess.Popen:
    (tmp_path / "rank.py").write_text(textwrap.dedent(RANK))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**teardown_probe.env(tmp_path, [agent.MODULE]), "PROBE_DIR": str(tmp_path),
           "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.Popen([*agent.argv(), "--standalone", "--nproc-per-node=1",
                             "--max-restarts=0", "--monitor-interval=0.2", *options,
                             str(tmp_path / "rank.py"), ending],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


@pytest.mark.parametrize("rank_exit", [0, 85, 86, 1])
def test_the_agent_ends_as_torchrun_for_each_rank_exit_without_the_teardown(tmp_path, rank_exit):
    proc = _start(tmp_path, str(rank_exit))
    try:
        out, err = (s.decode(errors="replace") for s in proc.communicate(timeout=WAIT_S))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # torchrun's status: 0, or its ChildFailedError (1) naming the rank's exit code
    assert proc.returncode == (0 if rank_exit == 0 else 1), err[-3000:]
    if rank_exit:
        assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in err, err[-3000:]
        assert re.search(rf"exitcode\s*:\s*{rank_exit}\b", err), err[-3000:]
    else:
        assert "Traceback" not in err, err[-3000:]
    assert "rank says hi" in out and out.endswith(teardown_probe.ATEXIT_TEXT), out
    assert not teardown_probe.tore_down(tmp_path), "the agent ran the interpreter's teardown"
    # torchrun's log directory (where a failed rank's error file is read from) is gone with it
    assert not list((tmp_path / "tmp").iterdir())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_agent_stops_its_rank_and_ends_it_as_torchrun(tmp_path, sig):
    proc = _start(tmp_path, "sleep")
    try:
        deadline = time.monotonic() + WAIT_S
        while not (tmp_path / "rank").exists() or not (tmp_path / "rank").read_text():
            assert time.monotonic() < deadline, f"the rank did not start within {WAIT_S:.0f} s"
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        rank = int((tmp_path / "rank").read_text())
        proc.send_signal(sig)
        out, err = (s.decode(errors="replace") for s in proc.communicate(timeout=WAIT_S))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # torchrun's handler: its workers stopped, then its SignalException, uncaught (1)
    assert proc.returncode == 1, err[-3000:]
    assert "SignalException" in err, err[-3000:]
    assert not alive(rank), "the agent ended and left its rank running"
    assert "rank says hi" in out and out.endswith(teardown_probe.ATEXIT_TEXT), out
    assert not teardown_probe.tore_down(tmp_path), "the agent ran the interpreter's teardown"
    # torchrun's log directory (where a failed rank's error file is read from) is gone with it
    assert not list((tmp_path / "tmp").iterdir())


def test_a_killed_agents_log_dir_is_removed_by_the_next_agent_on_the_node(tmp_path):
    proc = _start(tmp_path, "sleep")
    rank = None
    try:
        wait_until("the rank to start", lambda: (tmp_path / "rank").exists()
                   and (tmp_path / "rank").read_text(), WAIT_S)
        rank = int((tmp_path / "rank").read_text())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)   # as Slurm kills a node's step: nothing runs after
        proc.wait(timeout=WAIT_S)
        if rank is not None and alive(rank):
            os.kill(rank, signal.SIGKILL)
    left = list((tmp_path / "tmp").iterdir())
    assert [p.name.startswith(agent.LOG_DIR_PREFIX) for p in left] == [True], left
    long_ago = time.time() - 2 * ownedtmp.MIN_AGE_S   # a directory only minutes old is not judged
    os.utime(left[0], (long_ago, long_ago))
    (tmp_path / "rank").unlink()
    proc = _start(tmp_path, "0")
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err[-3000:]
    assert not list((tmp_path / "tmp").iterdir())


def test_a_log_dir_the_command_names_is_torchruns_and_kept(tmp_path):
    proc = _start(tmp_path, "1", f"--log-dir={tmp_path / 'logs'}")
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 1, err[-3000:]
    assert list((tmp_path / "logs").rglob("attempt_0"))   # torchrun's, left as it leaves them
    assert not list((tmp_path / "tmp").iterdir())


def test_the_agents_command_line_is_one_definition():
    argv = [*agent.argv("/py"), "--standalone", "x.py"]
    assert argv[:3] == ["/py", "-m", "slurmft.launch.agent"]
    assert agent.is_agent(argv) and agent.is_agent([a.encode() for a in argv])
    assert not agent.is_agent(["/py", "-m", "torch.distributed.run", "x.py"])
    assert not agent.is_agent(["/py"])
