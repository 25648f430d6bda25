"""The node's warm server forked from torchrun's agent (``slurmft.launch.warmfork``), on the
requeue path's node task (``task.run_torchrun``) as in in-allocation mode: real tasks, agents
(torchrun standalone), servers, clients and gloo ranks; the agent killed -9; a thread already
running in the agent (the server then starts as a process of its own). The in-allocation node
task with a restart is test_launch_warm_node.py's."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from procs import wait_until
from slurmft.launch import agent, nodesteps, warm, warmfork

PY = sys.executable
WAIT_S = 120.0

pytestmark = pytest.mark.timeout(240)

# Each rank writes: its pid, its server's pid, the server's comm, whether the server's argv is the
# agent's (forked from it), the all-reduce's result, and whether its environment is the task's
# (nothing of the agent's request for a server nor of the server's fork-safe import in it).
RANK = """
    import os, sys, time, torch, torch.distributed as dist
    out = sys.argv[1]
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    server = os.getppid()
    argv = open(f"/proc/{server}/cmdline", "rb").read().split(b"\\0")
    leaked = [v for v in ("SLURMFT_WARM_SERVE", "OPENBLAS_NUM_THREADS",
                          "PYTORCH_NVML_BASED_CUDA_CHECK") if v in os.environ]
    with open(os.path.join(out, f"rank{dist.get_rank()}"), "w") as f:
        f.write(f"{os.getpid()} {server} {open(f'/proc/{server}/comm').read().strip()} "
                f"{argv[1:3] == [b'-m', b'slurmft.launch.agent']} {t.item()} {leaked == []}")
    dist.destroy_process_group()
"""


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(body))
    return script


def _task_argv(script: Path, *args: str) -> list[str]:
    """The requeue path's node task around a standalone torchrun whose ranks are warm clients."""
    return [PY, "-m", "slurmft.launch.task", *agent.argv(PY), "--standalone", "--nproc-per-node=2",
            "--max-restarts=0", "--monitor-interval=0.2", "--no-python",
            *warm.worker_command([str(script), *args])]


@pytest.fixture
def node_tmp(monkeypatch):
    """A TMPDIR of the test's own: the server's directory and torchrun's are made there."""
    tmp = tempfile.mkdtemp(prefix="warmfork-", dir="/tmp")
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody reaped yet (an orphan's reaper is the host's)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _ours(tmp: str) -> list[str]:
    """What slurmft left in the node's TMPDIR (torch's own inductor cache is torch's)."""
    return [n for n in os.listdir(tmp) if n.startswith("slurmft-")]


def _env(tmp: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, **nodesteps.STEP_ENV, "TMPDIR": tmp, "SLURM_NODEID": "0", **extra}
    env.pop("SLURMFT_ALIVE_FILE", None)   # the requeue path's task
    return env


def test_the_requeue_paths_ranks_are_forked_from_a_server_forked_from_the_agent(tmp_path, node_tmp):
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, RANK)
    done = subprocess.run(_task_argv(script, str(out)), env=_env(node_tmp), timeout=WAIT_S,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = {p.name: p.read_text().split() for p in out.iterdir()}
    assert sorted(ranks) == ["rank0", "rank1"]
    servers = {server for _pid, server, *_ in ranks.values()}
    assert len(servers) == 1                           # one server for the node's two ranks
    assert all(rest == ["slurmft-warm", "True", "2.0", "True"] for _p, _s, *rest in ranks.values())
    assert done.stderr.count("forked warm as pid") == 2
    # the server ended with its agent; its directory and torchrun's went with the task
    assert not Path(f"/proc/{servers.pop()}").exists()
    assert _ours(node_tmp) == []


def test_a_term_to_the_requeue_paths_task_keeps_torchruns_bound_for_the_ranks(tmp_path, node_tmp):
    """Slurm's TERM reaches the task and torchrun (one process group): the task marks the node
    stopping, so a rank that takes longer than the clients' grace to save after torchrun's TERM
    is not killed at the grace (``warmclient.StopWatch``)."""
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, """
        import os, signal, sys, time
        def save(signum, frame):
            time.sleep(3)   # an emergency checkpoint: longer than the 1 s grace below
            open(os.path.join(sys.argv[1], f"saved{os.environ['RANK']}"), "w").close()
            sys.exit(85)
        signal.signal(signal.SIGTERM, save)
        open(os.path.join(sys.argv[1], f"up{os.environ['RANK']}"), "w").close()
        time.sleep(120)
    """)
    task = subprocess.Popen(_task_argv(script, str(out)), start_new_session=True,
                            env=_env(node_tmp, SLURMFT_WARM_STOP_GRACE_S="1"),
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until("both ranks up", lambda: {"up0", "up1"} <= set(os.listdir(out)), WAIT_S)
        os.killpg(task.pid, signal.SIGTERM)   # as slurmstepd signals a task under proctrack/pgid
        _, err = task.communicate(timeout=WAIT_S)
    finally:
        if task.poll() is None:
            os.killpg(task.pid, signal.SIGKILL)
            task.wait()
    assert {"saved0", "saved1"} <= set(os.listdir(out)), err[-3000:]
    assert "killed, not waiting for torchrun" not in err
    assert _ours(node_tmp) == []


def test_the_server_ends_when_its_agent_is_killed(tmp_path, node_tmp):
    """No task to stop it: the kernel TERMs the server (``PR_SET_PDEATHSIG``), which forks no
    more and ends once its workers have (their clients, orphaned, tell them: USR2)."""
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, """
        import os, sys, time
        open(os.path.join(sys.argv[1], f"{os.environ['RANK']}-{os.getpid()}-{os.getppid()}"),
             "w").close()
        time.sleep(120)
    """)
    sock = os.path.join(tempfile.mkdtemp(dir=node_tmp), "s")
    env = _env(node_tmp, **{warmfork.SERVE_ENV: sock, "SLURMFT_WARM_SOCKET": sock})
    argv = [*agent.argv(PY), "--standalone", "--nproc-per-node=2", "--monitor-interval=0.2",
            "--no-python", *warm.worker_command([str(script), str(out)])]
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    ranks: list[tuple[int, ...]] = []
    try:
        wait_until("both ranks up", lambda: len(os.listdir(out)) == 2, WAIT_S)
        ranks = [tuple(int(x) for x in name.split("-")) for name in os.listdir(out)]
        server = ranks[0][2]
        assert all(r[2] == server for r in ranks) and warm.is_server(server)
        proc.kill()
        proc.wait()
        wait_until("the server and its workers to end",
                   lambda: all(_gone(pid) for pid in (server, *(r[1] for r in ranks))), 30)
    finally:
        for pgid in (proc.pid, *(r[1] for r in ranks)):   # the workers run in sessions of their own
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def test_an_agent_with_a_thread_starts_its_server_apart(tmp_path, node_tmp):
    """A thread already running (a site's ``sitecustomize``): no fork; the server is started as a
    process of its own, serves the clients all the same, and is stopped with the agent."""
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, RANK)
    sock = os.path.join(tempfile.mkdtemp(dir=node_tmp), "s")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(   # in the agent only: a server with it could not fork
        "import threading, time\n"
        "if b'slurmft.launch.agent' in open('/proc/self/cmdline', 'rb').read():\n"
        "    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    env = _env(node_tmp, **{warmfork.SERVE_ENV: sock, "SLURMFT_WARM_SOCKET": sock,
                            "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])})
    argv = [*agent.argv(PY), "--standalone", "--nproc-per-node=2", "--monitor-interval=0.2",
            "--no-python", *warm.worker_command([str(script), str(out)])]
    done = subprocess.run(argv, env=env, timeout=WAIT_S, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the warm server starts as a process of its own" in done.stderr
    ranks = [p.read_text().split() for p in out.iterdir()]
    assert len(ranks) == 2 and all(r[2:] == ["slurmft-warm", "False", "2.0", "True"] for r in ranks)
    assert not Path(f"/proc/{ranks[0][1]}").exists()   # stopped at the agent's end


def test_the_fork_safe_import_leaves_the_environment_as_it_was(monkeypatch):
    env = {"OPENBLAS_NUM_THREADS": "4"}
    warmfork.import_for_fork("json", env)
    assert env == {"OPENBLAS_NUM_THREADS": "4"}
    warmfork.import_for_fork("no_such_module_here", env)   # torchrun's own start reports it
    assert env == {"OPENBLAS_NUM_THREADS": "4"}
    assert warmfork.start({}) is None   # not asked: no server


def test_a_server_socket_left_by_a_dead_server_is_replaced(tmp_path):
    path = str(tmp_path / "s")
    first = warm.listen(path)
    first.close()                   # its server died: the file stays
    second = warm.listen(path)
    try:
        assert os.path.exists(path)
    finally:
        second.close()


def test_a_spares_torchrun_started_ahead_forks_its_server_before_the_go(tmp_path, node_tmp):
    """``pretorchrun`` (a hot spare's torchrun, imported and waiting): the server is there while
    it waits, without the task's go pipe; never activated (EOF), both end."""
    sock = os.path.join(tempfile.mkdtemp(dir=node_tmp), "s")
    read_fd, write_fd = os.pipe()
    env = _env(node_tmp, **{warmfork.SERVE_ENV: sock, "SLURMFT_WARM_SOCKET": sock,
                            "SLURMFT_WARM_IMPORTS": ""})
    proc = subprocess.Popen([PY, "-m", "slurmft.launch.pretorchrun", "--go-fd", str(read_fd), "--",
                             "--standalone", "x.py"], env=env, pass_fds=(read_fd,))
    os.close(read_fd)
    go = None
    try:
        wait_until("the spare's agent holding its go pipe",
                   lambda: os.path.exists(f"/proc/{proc.pid}/fd/{read_fd}"), WAIT_S)
        go = os.readlink(f"/proc/{proc.pid}/fd/{read_fd}")

        def servers() -> list[int]:
            kids = [int(p) for t in os.listdir(f"/proc/{proc.pid}/task")
                    for p in Path(f"/proc/{proc.pid}/task/{t}/children").read_text().split()]
            return [k for k in kids if warm.is_server(k)]

        def holds_go(pid: int) -> bool:
            try:
                return any(os.readlink(f"/proc/{pid}/fd/{fd}") == go for fd in os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                return True

        wait_until("the spare's server, named and without the go pipe",
                   lambda: len(servers()) == 1 and not holds_go(servers()[0]), WAIT_S)
        server = servers()[0]
        os.close(write_fd)            # the task stopped: no go
        write_fd = None
        assert proc.wait(timeout=WAIT_S) == 0
        wait_until("the server to end", lambda: _gone(server), 30)
    finally:
        if write_fd is not None:
            os.close(write_fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stop_before_the_server_serves_ends_it_at_once(tmp_path):
    """A TERM while the server still imports (torchrun failed at once, a spare never activated):
    it ends without finishing them, its socket removed."""
    path = str(tmp_path / "s")
    site = tmp_path / "site"
    site.mkdir()
    (site / "slow_import_for_test.py").write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([PY, "-m", "slurmft.launch.warm", "--socket", path, "--imports",
                             "json,slow_import_for_test"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(site)})
    try:
        wait_until("the server's socket", lambda: os.path.exists(path), WAIT_S)
        time.sleep(0.5)
        started = time.monotonic()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - started < 20 and proc.returncode == 0, err
        assert "stopped before it served" in err and not os.path.exists(path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_fork_that_fails_leaves_the_nodes_ranks_cold(tmp_path, monkeypatch):
    path = str(tmp_path / "s")

    def no_fork() -> int:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(warmfork, "_threads", lambda: 1)
    monkeypatch.setattr(warmfork.threading, "active_count", lambda: 1)
    monkeypatch.setattr(warmfork.os, "fork", no_fork)
    assert warmfork.start({warmfork.SERVE_ENV: path}) is None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(ConnectionRefusedError):   # a client runs its rank cold at once
        probe.connect(path)
    probe.close()


def test_the_socket_appears_only_once_it_listens(tmp_path, monkeypatch):
    """A client polls for the path and takes a refusal for a dead server's (its rank then runs
    cold): the path must never name a socket that is bound but not yet listening. A staging
    socket a server left when it died between the two is no obstacle."""
    path = str(tmp_path / "s")
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(path + warm.STAGING_SUFFIX)
    left.close()
    seen = []

    class Watched(socket.socket):
        def listen(self, *args) -> None:
            seen.append(os.path.exists(path))
            super().listen(*args)

    monkeypatch.setattr(warm.socket, "socket", Watched)
    sock = warm.listen(path)
    monkeypatch.undo()
    try:
        assert seen == [False]
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(path)
        probe.close()
        assert os.listdir(tmp_path) == ["s"]
    finally:
        sock.close()


def test_a_live_servers_socket_or_another_file_is_never_replaced(tmp_path):
    path = str(tmp_path / "s")
    live = warm.listen(path)
    try:
        with pytest.raises(OSError, match="already listens"):
            warm.listen(path)
    finally:
        live.close()
    other = tmp_path / "f"
    other.write_text("a user's file")
    with pytest.raises(OSError, match="not a socket"):
        warm.listen(str(other))
    assert other.read_text() == "a user's file"


def test_a_server_ending_late_leaves_a_later_servers_socket(tmp_path):
    path = str(tmp_path / "s")
    old = warm.Server(path)
    old.sock.close()                # it died without removing it (or is still importing)
    time.sleep(0.05)                # a later start: the file's times are a clock tick apart
    new = warm.Server(path)         # a later one takes the path (often the same inode number)
    try:
        old.close()                 # the old one's end, late
        assert os.path.exists(path)
    finally:
        new.close()
    assert not os.path.exists(path)
