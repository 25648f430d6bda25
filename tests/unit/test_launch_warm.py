"""Warm workers (slurmft.launch.warm / warmclient, issue 27): real server and client processes,
real sockets and signals. Most servers pre-import only ``json`` (the mechanics are the same and
they start in a blink); the torch tests pre-import torch as a node's server does."""

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

from procs import alive, wait_until
from slurmft.launch import warm, warmclient, warmtask

PY = sys.executable
CLIENT = [PY, "-I", "-S", warmclient.__file__, "--"]
WAIT_S = 120.0   # a loaded 2-core box: bound every liveness wait generously


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return [c for c in found if alive(c)]


class Srv:
    def __init__(self, imports: str, env: dict[str, str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="slurmft-warm-test-", dir="/tmp")
        self.path = os.path.join(self.dir, "s")
        self.proc = subprocess.Popen([PY, "-m", "slurmft.launch.warm", "--socket", self.path,
                                      "--imports", imports], stderr=subprocess.PIPE, text=True,
                                     env=env)

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, warmclient.SOCKET_ENV: self.path, **extra}

    def stop(self) -> str:
        warmtask.stop_server(self.proc, self.path)
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


def test_what_the_server_imported_is_frozen_before_it_forks(srv, tmp_path):
    """The server's heap (torch's ~170k objects on a node) is out of the collector's reach in
    every worker: no full collection of a rank, nor its end's scan for open files, walks it."""
    script = _script(tmp_path, """
        import gc, json
        print(gc.get_freeze_count() > 0, any(o is json.dumps for o in gc.get_objects()))
    """)
    res = _run(srv, [str(script)], tmp_path)
    assert (res.returncode, res.stdout.split()) == (0, ["True", "False"]), res.stderr


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


@pytest.mark.parametrize("ending, code", [
    ("pass", 0), ("sys.exit(85)", 85), ("raise SystemExit(86)", 86),
    ("raise ValueError('boom')", 1), ("raise KeyboardInterrupt", -signal.SIGINT),
])
def test_a_worker_ends_without_the_interpreters_teardown_and_loses_nothing(srv, tmp_path, ending, code):
    """A warm rank ends with ``os._exit`` after what the interpreter does at a script's end (its
    teardown costs ~0.9 CPU-s with torch loaded): the exit status is kept, a non-daemon thread
    (a save in flight) is joined, the atexit handlers ran (the journal's buffered last event is
    on disk), a file left open is flushed; and the teardown, which the old worker ran, never
    starts (an object in ``__main__`` that it would free is its probe)."""
    run_dir, probe = tmp_path / "run", tmp_path / "teardown"
    script = _script(tmp_path, f"""
        import os, sys, threading, time
        from slurmft.journal import Journal, LOSS
        class Probe:   # freed by the teardown, which clears __main__; never by the rank
            def __del__(self, _open=os.open, _close=os.close, _flags=os.O_WRONLY | os.O_CREAT):
                _close(_open({str(probe)!r}, _flags))
        probe = Probe()
        os.mkdir({str(run_dir)!r})
        journal = Journal({str(run_dir)!r}, job_id="1", restart_count=0)
        journal.append(LOSS, step=7, loss=0.5)   # buffered: written by its atexit handler
        left_open = open({str(tmp_path / "left_open")!r}, "w")
        left_open.write("unclosed")
        def save():
            time.sleep(0.5)
            with open({str(tmp_path / "saved")!r}, "w") as f:
                f.write("committed")
        threading.Thread(target=save).start()
        print("last words", end="")
        {ending}
    """)
    res = _run(srv, [str(script)], tmp_path)
    assert res.returncode == code, res.stderr
    assert res.stdout == "last words"
    if code == 1:
        assert res.stderr.splitlines()[-1] == "ValueError: boom"
    assert (tmp_path / "saved").read_text() == "committed"
    assert (tmp_path / "left_open").read_text() == "unclosed"
    assert '"step":7' in (run_dir / "events.jsonl").read_text().replace(" ", "")
    assert not probe.exists(), "the worker ran the interpreter's teardown"


def test_the_server_ends_without_the_interpreters_teardown(tmp_path):
    """The server has torch loaded too: at its TERM it ends, 0, without the teardown (a module
    it imported, which the teardown would free, is the probe; only the server's own pid counts,
    not its worker's)."""
    probe = tmp_path / "teardown"
    (tmp_path / "teardown_probe.py").write_text(textwrap.dedent(f"""
        import os
        class Probe:
            def __init__(self):
                self.pid = os.getpid()
            def __del__(self, _getpid=os.getpid, _open=os.open, _close=os.close,
                        _flags=os.O_WRONLY | os.O_CREAT):
                if _getpid() == self.pid:
                    _close(_open({str(probe)!r}, _flags))
        probe = Probe()
    """))
    server = Srv("json,teardown_probe", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:   # one rank served: the server has imported the probe
        res = _run(server, [str(_script(tmp_path, "pass"))], tmp_path)
        assert res.returncode == 0, res.stderr
    finally:
        err = server.stop()
    assert server.proc.returncode == 0, err
    assert not probe.exists(), "the server ran the interpreter's teardown"


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
    wait_until("the worker's ready file", ready.exists)
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
    wait_until("the worker's pid file", pids.exists)
    worker, child = (int(p) for p in pids.read_text().split())
    assert alive(worker) and alive(child)
    proc.kill()
    proc.wait(timeout=WAIT_S)
    wait_until("the worker and its child to die with the client",
           lambda: not alive(worker) and not alive(child))


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
        wait_until("the worker's pid file", pids.exists)
        worker = int(pids.read_text())
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            proc.kill()
            proc.wait(timeout=WAIT_S)
            wait_until("the worker to end by its own watch", lambda: not alive(worker))
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    finally:
        server.stop()


def test_a_worker_keeps_its_fds_when_the_servers_objects_are_collected(srv, tmp_path):
    """The fork inherits the server's socket objects (its listening socket, its other clients'
    connections). They must be closed as objects: closed by number, each later closed that number
    again when collected (at the rank's exit, after its script), and by then the number was the
    rank's own (gloo's sockets: a save in flight stuck, gloo's abort, a hung teardown). Two other
    clients are live when this worker is forked, so the server holds their connections."""
    release = tmp_path / "release"
    holder = _script(tmp_path, f"""
        import os, time
        while not os.path.exists({str(release)!r}):
            time.sleep(0.05)
    """, "holder.py")
    script = _script(tmp_path, """
        import atexit, gc, os, socket
        held = [socket.socket() for _ in range(8)]   # the lowest free numbers, as gloo's would be
        def check():
            gc.collect()   # what the interpreter's teardown does: the server's frames are freed
            closed = []
            for sock in held:
                try:
                    os.fstat(sock.fileno())
                except OSError:
                    closed.append(sock.fileno())
            print(f"closed behind the rank's back: {closed}", flush=True)
        atexit.register(check)
    """)
    before = set(_children(srv.proc.pid))
    holders = [_start(srv, holder, tmp_path) for _ in range(2)]
    try:
        wait_until("both holders' workers", lambda: len(set(_children(srv.proc.pid)) - before) >= 2)
        res = _run(srv, [str(script)], tmp_path)
    finally:
        release.touch()
        for proc in holders:
            proc.communicate(timeout=WAIT_S)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "closed behind the rank's back: []", res.stdout + res.stderr


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
    wait_until("the worker's ready file", ready.exists)
    parent.kill()
    parent.wait(timeout=WAIT_S)
    wait_until("the worker to be told (SIGUSR2) and end", lambda: told.exists() and not alive(client_pid))


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
        wait_until("the worker's pid file", pids.exists)
        worker = int(pids.read_text())
        server.proc.kill()
        server.proc.wait(timeout=WAIT_S)
        _, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 1 and "lost the warm server" in err
        wait_until("the worker to die with its server", lambda: not alive(worker))
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


def _mapped_libz() -> str:
    import zlib  # noqa: F401  (maps the system's libz into this process)
    with open("/proc/self/maps") as f:
        paths = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split()) == 6}
    return next(p for p in paths if os.path.basename(p).startswith("libz.so"))


def test_a_server_whose_imports_load_the_cuda_driver_refuses_and_clients_run_cold(tmp_path):
    """No GPU here: a copy of a real shared library named as the driver (libcuda.so.1), loaded by
    a pre-imported module through ctypes as a module calling the driver without torch would.
    torch's own flag says nothing; the server's maps show the library, and it refuses."""
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(Path(_mapped_libz()).read_bytes())
    (tmp_path / "drivercall.py").write_text(f"import ctypes\nctypes.CDLL({str(lib)!r})\n")
    server = Srv("json,drivercall", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:
        res = _run(server, [str(_script(tmp_path, "print('ran')\n"))], tmp_path)
    finally:
        log = server.stop()
    assert res.returncode == 0 and res.stdout.strip() == "ran"
    assert "starting this rank cold" in res.stderr
    refusals = [line for line in log.splitlines() if "no warm workers on this node" in line]
    assert len(refusals) == 1 and f"CUDA driver library {lib}" in refusals[0]


def test_the_cuda_driver_is_found_in_maps_and_the_runtime_is_not(tmp_path):
    maps = tmp_path / "maps"
    runtime = ("7f1c2a000000-7f1c2a100000 r-xp 00000000 08:01 1234 "
               "/usr/local/cuda-13.0/lib/libcudart.so.13\n")
    maps.write_text(runtime + "7f1c2b000000-7f1c2b001000 rw-p 00000000 00:00 0 \n")
    assert warm.cuda_driver_mapped(str(maps)) is None
    for name in ("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", "/opt/my dir/libcuda.so.1",
                 "/usr/lib64/libcuda.so", "/usr/lib64/libcuda.so.1 (deleted)"):
        maps.write_text(runtime + f"7f1c2c000000-7f1c2c100000 r-xp 00000000 08:01 99 {name}\n")
        assert warm.cuda_driver_mapped(str(maps)) == name
    assert "cannot read" in warm.cuda_driver_mapped(str(tmp_path / "absent"))
    assert warm.cuda_driver_mapped() is None   # this test process: torch's CPU build, no driver


def test_a_term_that_came_while_the_client_waited_for_its_fork_ends_the_rank(tmp_path):
    """torchrun stops a round's workers with TERM, also ones still waiting for their fork (the
    server importing): the TERM is relayed as soon as the worker exists, and must be the rank's
    (default action: it dies) even though the fork has not yet set the rank's dispositions or
    its own session. It was lost: the rank trained on in a world torchrun had left, and
    torchrun waited 30 s to KILL its client (benchmarks/recovery_bench.py, a shrink's start)."""
    (tmp_path / "slowimport.py").write_text("import time\ntime.sleep(4)\n")
    server = Srv("json,slowimport", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    script = _script(tmp_path, "import time\ntime.sleep(60)\nprint('trained on')\n")
    try:
        proc = subprocess.Popen([*CLIENT, str(script)], cwd=tmp_path, env=server.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def connected() -> bool:   # its handlers are installed before its socket exists
            try:
                return any(os.readlink(f"/proc/{proc.pid}/fd/{fd}").startswith("socket:")
                           for fd in os.listdir(f"/proc/{proc.pid}/fd"))
            except OSError:
                return False

        wait_until("the client's connection", connected)
        assert server.proc.poll() is None   # the server still imports: no fork yet
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        log = server.stop()
    assert "forked warm" in log          # the worker was forked after the TERM came...
    assert proc.returncode == -signal.SIGTERM and "trained on" not in out, err   # ...and died of it
