"""Warm workers (slurmft.launch.warm / warmclient, issue 27): real server and client processes,
real sockets and signals. Most servers pre-import only ``json`` (the mechanics are the same and
they start in a blink); the torch tests pre-import torch as a node's server does."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from slurmft.launch import warm, warmclient

PY = sys.executable
CLIENT = [PY, "-I", "-S", warmclient.__file__, "--"]
WAIT_S = 120.0   # a loaded 2-core box: bound every liveness wait generously


def _until(what: str, cond, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Srv:
    def __init__(self, imports: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="slurmft-warm-test-", dir="/tmp")
        self.path = os.path.join(self.dir, "s")
        self.proc = subprocess.Popen([PY, "-m", "slurmft.launch.warm", "--socket", self.path,
                                      "--imports", imports], stderr=subprocess.PIPE, text=True)

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, warmclient.SOCKET_ENV: self.path, **extra}

    def stop(self) -> str:
        warm.stop_server(self.proc, self.path)
        return self.proc.stderr.read() if self.proc.stderr else ""


@pytest.fixture(scope="module")
def srv():
    server = Srv("json")
    yield server
    server.stop()


def _script(tmp_path: Path, body: str, name: str = "s.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _run(srv: Srv, argv: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = kw.pop("env", srv.env())
    return subprocess.run([*CLIENT, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=WAIT_S, **kw)


def test_worker_gets_argv_env_cwd_stdio_and_exit_code(srv, tmp_path):
    script = _script(tmp_path, """
        import os, sys, json
        line = sys.stdin.readline().strip()
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("X_WARM"),
                          "stdin": line, "ppid": os.getppid(), "name": __name__,
                          "loader": type(__loader__).__name__, "main": sys.modules["__main__"].__file__,
                          "path0": sys.path[0], "pgid_is_pid": os.getpgrp() == os.getpid()}))
        print("to stderr", file=sys.stderr)
        sys.exit(7)
    """)
    cwd = tmp_path / "wd"
    cwd.mkdir()
    res = _run(srv, [str(script), "a", "b c"], cwd, input="from stdin\n", env=srv.env(X_WARM="yes"))
    assert res.returncode == 7, res.stderr
    import json
    out = json.loads(res.stdout)
    assert out["argv"] == [str(script), "a", "b c"]
    assert out["cwd"] == str(cwd) and out["x"] == "yes" and out["stdin"] == "from stdin"
    assert out["name"] == "__main__" and out["path0"] == str(tmp_path)
    assert out["loader"] == "SourceFileLoader" and out["main"] == str(script)   # as python's own
    assert out["ppid"] == srv.proc.pid          # forked by the warm server, not a cold start
    assert out["pgid_is_pid"]                   # its own process group, as torchrun's ranks
    assert res.stderr.strip() == "to stderr"    # nothing of the client's own


def test_module_runs_as_main(srv, tmp_path):
    pkg = tmp_path / "wpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _script(pkg, "import sys\nprint(__name__, sys.argv[1:])\nraise SystemExit(3)\n", "mod.py")
    res = _run(srv, ["-m", "wpkg.mod", "z"], tmp_path)
    assert (res.returncode, res.stdout.strip()) == (3, "__main__ ['z']"), res.stderr


def test_worker_ends_like_an_interpreter(srv, tmp_path):
    script = _script(tmp_path, """
        import atexit, sys, threading, time
        atexit.register(lambda: print("atexit ran"))
        def late():
            time.sleep(0.5)
            print("thread joined")
        threading.Thread(target=late).start()
        sys.stdout.write("unflushed:")
    """)
    res = _run(srv, [str(script)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "unflushed:thread joined\natexit ran\n"


@pytest.mark.parametrize("body, code, text", [
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("import sys; sys.exit('a message')", 1, "a message"),
])
def test_uncaught_exception_and_exit_message(srv, tmp_path, body, code, text):
    res = _run(srv, [str(_script(tmp_path, body))], tmp_path)
    assert res.returncode == code and text in res.stderr.splitlines()[-1]


def test_missing_script_is_exit_2_as_python_says(srv, tmp_path):
    res = _run(srv, ["nope.py"], tmp_path)
    assert res.returncode == 2 and "can't open file 'nope.py'" in res.stderr


def _start(srv: Srv, script: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    # As torchrun starts a rank: its own session, so torchrun's killpg reaches only the client.
    return subprocess.Popen([*CLIENT, str(script)], cwd=cwd, env=env or srv.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_signals_to_the_client_reach_the_worker(srv, tmp_path):
    ready = tmp_path / "ready"
    script = _script(tmp_path, f"""
        import os, signal, sys, time
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append("USR1"))
        signal.signal(signal.SIGTERM, lambda s, f: (print(got, "TERM"), sys.exit(42)))
        open({str(ready)!r}, "w").write(str(os.getpid()))
        while True:
            time.sleep(0.05)
    """)
    proc = _start(srv, script, tmp_path)
    _until("the worker's ready file", ready.exists)
    os.killpg(proc.pid, signal.SIGUSR1)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)             # what torchrun's stop does
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 42, err
    assert out.strip() == "['USR1'] TERM"


def test_worker_killed_by_a_signal_client_dies_of_it(srv, tmp_path):
    script = _script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    proc = _start(srv, script, tmp_path)
    proc.communicate(timeout=WAIT_S)
    assert proc.returncode == -signal.SIGKILL        # torchrun sees what it would of a rank


def test_client_killed_9_takes_its_worker_and_children(srv, tmp_path):
    pids = tmp_path / "pids"
    script = _script(tmp_path, f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pids)!r} + ".tmp", "w").write(f"{{os.getpid()}} {{child.pid}}")
        os.rename({str(pids)!r} + ".tmp", {str(pids)!r})
        time.sleep(600)
    """)
    proc = _start(srv, script, tmp_path)
    _until("the worker's pid file", pids.exists)
    worker, child = (int(p) for p in pids.read_text().split())
    assert _alive(worker) and _alive(child)
    proc.kill()
    proc.wait(timeout=WAIT_S)
    _until("the worker and its child to die with the client",
           lambda: not _alive(worker) and not _alive(child))


def test_the_worker_watches_its_client_itself(tmp_path):
    """The server frozen (it cannot kill anything): the client's kill -9 still ends the worker,
    by the worker's own watch of its client's pid."""
    server = Srv("json")
    pids = tmp_path / "pid"
    script = _script(tmp_path, f"""
        import os, time
        open({str(pids)!r} + ".tmp", "w").write(str(os.getpid()))
        os.rename({str(pids)!r} + ".tmp", {str(pids)!r})
        time.sleep(600)
    """)
    try:
        proc = _start(server, script, tmp_path)
        _until("the worker's pid file", pids.exists)
        worker = int(pids.read_text())
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            proc.kill()
            proc.wait(timeout=WAIT_S)
            _until("the worker to end by its own watch", lambda: not _alive(worker))
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    finally:
        server.stop()


def test_orphaned_client_gives_its_worker_usr2(srv, tmp_path):
    """torchrun gone (the client reparented): the rank is told as its own orphan watch would."""
    ready, told = tmp_path / "ready", tmp_path / "told"
    script = _script(tmp_path, f"""
        import signal, sys, time
        signal.signal(signal.SIGUSR2, lambda s, f: (open({str(told)!r}, "w").close(), sys.exit(85)))
        open({str(ready)!r}, "w").close()
        time.sleep(600)
    """)
    parent = subprocess.Popen(
        [PY, "-c", "import subprocess, sys, time; "
         "p = subprocess.Popen(sys.argv[1:], start_new_session=True); print(p.pid, flush=True); "
         "time.sleep(600)", *CLIENT, str(script)],
        cwd=tmp_path, env=srv.env(), stdout=subprocess.PIPE, text=True)
    client_pid = int(parent.stdout.readline())
    _until("the worker's ready file", ready.exists)
    parent.kill()
    parent.wait(timeout=WAIT_S)
    _until("the worker to be told (SIGUSR2) and end", lambda: told.exists() and not _alive(client_pid))


def test_the_servers_death_takes_its_workers_and_later_clients_run_cold(tmp_path):
    """Fail closed: a worker nobody can reap is not left running; a dead server's socket
    refuses at once (no wait for a server that will never listen)."""
    server = Srv("json")
    pids = tmp_path / "pid"
    script = _script(tmp_path, f"""
        import os, time
        open({str(pids)!r} + ".tmp", "w").write(str(os.getpid()))
        os.rename({str(pids)!r} + ".tmp", {str(pids)!r})
        time.sleep(600)
    """)
    try:
        proc = _start(server, script, tmp_path)
        _until("the worker's pid file", pids.exists)
        worker = int(pids.read_text())
        server.proc.kill()
        server.proc.wait(timeout=WAIT_S)
        _, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 1 and "lost the warm server" in err
        _until("the worker to die with its server", lambda: not _alive(worker))
        assert os.path.exists(server.path)            # left behind by a killed server
        res = _run(server, [str(_script(tmp_path, "print('cold')\n", "c.py"))], tmp_path)
        assert res.stdout.strip() == "cold" and "starting this rank cold" in res.stderr
    finally:
        server.stop()


def test_no_server_runs_the_rank_cold(tmp_path):
    script = _script(tmp_path, "import os; print(os.getppid() == int(os.environ['P']))\n")
    env = {**os.environ, warmclient.SOCKET_ENV: str(tmp_path / "absent" / "s")}
    proc = subprocess.Popen([*CLIENT, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "P": str(os.getpid())})
    out, err = proc.communicate(timeout=WAIT_S)
    # exec'd in place: the rank is the client's own process, a child of ours
    assert proc.returncode == 0 and out.strip() == "True"
    assert "starting this rank cold" in err


def test_a_server_that_cannot_warm_refuses_and_clients_run_cold(tmp_path):
    server = Srv("json,no_such_module_for_warm")
    try:
        res = _run(server, [str(_script(tmp_path, "print('ran')\n"))], tmp_path)
    finally:
        log = server.stop()
    assert res.returncode == 0 and res.stdout.strip() == "ran"
    assert "no_such_module_for_warm" in res.stderr and "starting this rank cold" in res.stderr
    assert "no warm workers on this node: import no_such_module_for_warm failed" in log


# -- settings and the launch argv ---------------------------------------------------------------

@pytest.mark.parametrize("env, problem", [
    ({"SLURMFT_WARM_WORKERS": "yes"}, "SLURMFT_WARM_WORKERS='yes' must be 0 or 1"),
    ({"SLURMFT_WARM_WORKERS": "1", "SLURMFT_WARM_IMPORTS": "numpy,os;rm"}, "'os;rm' is not"),
])
def test_bad_settings_name_the_variable(env, problem):
    with pytest.raises(warm.WarmSettingsError, match=problem.replace("(", r"\(")):
        warm.settings(env)


def test_settings_default_and_extra_imports():
    assert warm.settings({}) == (False, warm.DEFAULT_IMPORTS)
    assert warm.DEFAULT_IMPORTS[0] == "torch" and "slurmft.train.run" in warm.DEFAULT_IMPORTS
    assert warm.settings({"SLURMFT_WARM_WORKERS": "1", "SLURMFT_WARM_IMPORTS": " numpy, torch ,"}) \
        == (True, (*warm.DEFAULT_IMPORTS, "numpy"))


# -- torch: a real node server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_srv():
    server = Srv("torch,torch.distributed")
    yield server
    server.stop()


def test_two_warm_workers_form_a_gloo_world(torch_srv, tmp_path):
    script = _script(tmp_path, """
        import os, sys, torch, torch.distributed as dist
        assert "torch" in sys.modules
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(dist.get_world_size(), t.item(), torch.get_num_threads())
        dist.destroy_process_group()
    """)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_start(torch_srv, script, tmp_path, env=torch_srv.env(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
        WORLD_SIZE="2", OMP_NUM_THREADS="1")) for r in range(2)]
    outs = [p.communicate(timeout=WAIT_S) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split() == ["2", "3.0", "1"]   # OMP_NUM_THREADS of the rank, not the server's


def _four(**env: str):
    from launch_envs import recorded

    from slurmft.launch import alloc_settings, identity
    full = {**recorded("nonarray"), "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4",
            "SLURM_NNODES": "4", "SLURMFT_RUN_DIR": "/runs/a", **env}
    return alloc_settings.from_environ(full, identity.from_environ(full)), full


def test_warm_workers_are_opt_in_and_only_with_in_allocation_mode():
    from slurmft.launch.settings import SettingsError
    assert _four(SLURMFT_SPARE_NODES="1")[0].warm_workers is False
    assert _four(SLURMFT_SPARE_NODES="1", SLURMFT_WARM_WORKERS="1")[0].warm_workers is True
    with pytest.raises(SettingsError, match="SLURMFT_WARM_WORKERS=1 needs in-allocation mode"):
        _four(SLURMFT_WARM_WORKERS="1")
    with pytest.raises(SettingsError, match="SLURMFT_WARM_IMPORTS"):
        _four(SLURMFT_IN_ALLOCATION="1", SLURMFT_WARM_IMPORTS="a b")


def test_the_node_step_runs_the_client_after_no_python_only_when_on():
    from slurmft.launch import identity, nodesteps, settings
    from slurmft.launch.rendezvous import Rendezvous
    rdzv = Rendezvous("n1", 40001, "slurmft-1-0")
    for on in ("0", "1"):
        alloc, full = _four(SLURMFT_SPARE_NODES="1", SLURMFT_WARM_WORKERS=on)
        cfg = settings.from_environ(full, identity.from_environ(full))
        argv = nodesteps.node_argv("n2", rdzv, alloc, cfg, ["-m", "pkg.train", "--x"], python="/py")
        tail = argv[argv.index("--monitor-interval=0.5") + 1:]
        if on == "1":
            assert tail == ["--no-python", "/py", "-I", "-S", warmclient.__file__, "--",
                            "-m", "pkg.train", "--x"]
        else:
            assert tail == ["-m", "pkg.train", "--x"]


def test_a_node_task_serves_torchrun_restarts_from_its_warm_server(tmp_path, monkeypatch):
    """The node's whole chain for real: the task starts the server, torchrun (standalone, two
    ranks, one restart) starts clients, the ranks are forked warm, form a gloo world, and the
    restart's ranks are forked again; torchrun's exit status comes back through the task."""
    from slurmft.launch import nodesteps, task
    from slurmft.rundir import RunDir
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, f"""
        import os, sys, torch, torch.distributed as dist
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        with open(os.path.join({str(out)!r}, f"{{attempt}}-{{dist.get_rank()}}"), "w") as f:
            parent = open(f"/proc/{{os.getppid()}}/cmdline", "rb").read().split(b"\\0")
            f.write(f"{{os.getppid()}} {{t.item()}} {{b'slurmft.launch.warm' in parent}}")
        dist.destroy_process_group()
        sys.exit(1 if attempt == 0 else 0)
    """)
    tmp = tempfile.mkdtemp(prefix="warm-task-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", tmp)
    monkeypatch.setenv("SLURMFT_WARM_WORKERS", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    for name, value in nodesteps.STEP_ENV.items():   # as the launcher's steps (a restart needs it)
        monkeypatch.setenv(name, value)
    argv = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "--max-restarts=1", "--monitor-interval=0.2", "--no-python",
            *warm.worker_command([str(script)])]
    assert task.supervise(argv, RunDir(tmp_path).alive("n1")) == 0
    results = {p.name: p.read_text().split() for p in out.iterdir()}
    assert sorted(results) == ["0-0", "0-1", "1-0", "1-1"]
    servers = {ppid for ppid, *_ in results.values()}
    assert len(servers) == 1                       # every rank of both attempts: one warm server
    assert all(rest == ["2.0", "True"] for _, *rest in results.values())
    # the server stopped, its socket and directory gone (torchrun leaves its own behind)
    assert [n for n in os.listdir(tmp) if n.startswith("slurmft-warm-")] == []
    shutil.rmtree(tmp)


def test_restart_phases_of_a_warm_worker_start_at_the_fork(monkeypatch):
    """slurmft.train.run imported by the server before the fork: the rank's imports were ready
    at its process start (import 0 s), and its set-up is not counted from the server's import."""
    from slurmft.train import phases
    now = time.time()
    monkeypatch.setattr(phases, "process_start_time", lambda: now - 2.0)
    marks = phases.RestartPhases(torch_imported=now - 300.0)
    fields = marks.event()
    assert fields["torch_imported"] == now - 2.0 and fields["import_s"] == 0.0
    assert 2.0 <= fields["setup_s"] < 300.0


def test_the_server_imports_fork_safely_configured(monkeypatch):
    """OpenBLAS without its thread pool, CUDA availability asked of NVML (no cuInit before a
    fork); a user's own values are kept (the ranks get their own environment anyway)."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    warm.prepare(["json"])
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    warm.prepare(["json"])
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
