"""The unit tests' gloo ranks forked from warm servers instead of started cold (issue 28).

A test that starts a real rank as ``python SCRIPT ARGS`` pays ``import torch`` for each one
(~2.5 s of CPU on the 2-core box, 5-10 s at load), and the suite is CPU-bound. The product's warm
workers (``slurmft.launch.warm`` and its torch-free client ``warmclient``, issue 27) fork a rank
from a server that imported torch once. ``WarmRanks.popen`` starts the rank as that client, with
the cold start's argv, environment, cwd and stdio: the client hands them to the server, whose fork
runs the script as ``__main__`` and ends as an interpreter does; the client exits with the rank's
code (killed by signal N: the client dies of N, so ``returncode`` is -N), relays the signals sent
to it, and its death kills the rank.

What the tests must not lose:

- A rank's *own* pid for the signals a test sends it: ``kill``/``kill_all`` (SIGKILL "at any
  moment" kills the rank at that moment, not its client a moment before it) and ``send_signal``
  (SIGSTOP stops the rank, not its client) go to the forked worker, found exactly: the server's
  child that holds a pidfd of this client (``warmworker`` watches its client through one).
- What a fork cannot give: a variable read *at import* by torch or slurmft takes the server's
  value. A server is started per import-time environment: the rank's environment without
  ``LATE`` (the variables read only after the imports; ``test_warm_ranks.py`` checks that the
  imports read none of them), so a rank with ``SLURMFT_TORCH_PUBLIC_ONLY=1`` gets a server that
  imported with it.
- Distinct string hashing: two cold ranks never share ``PYTHONHASHSEED``'s random seed, the forks
  of one server do. Each environment has two servers (``LANES``), even ranks on one, odd on the
  other, so a 2-rank world's ranks still hash differently (a rank that iterates a set differently
  from its peer still shows).

One pool per pytest process (per xdist worker): the session fixture ``warm_ranks``, which test
modules take in with ``pytest_plugins = ("warm_ranks",)``. A server is started on first use and
waited for (its imports, ``READY_S``) before the ranks start; the usual environment's servers
before the first test that takes the fixture, outside its timeout. A server dies with the thread that
started it (``PR_SET_PDEATHSIG``: a killed pytest worker leaves no server behind), and is stopped
at the session's end. A server that cannot warm refuses, and its clients run their rank cold with
one line on stderr: slower, never wrong (``test_warm_ranks.py`` fails then).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest

from slurmft.launch import warm, warmclient, warmtask

# Read by the ranks only after the server's imports (torch.distributed's init, slurmft's
# JobEnv and settings, the checkpoint fault hooks, pytest's own per-test marker): a rank may
# differ from its server in these and still run exactly as a cold start would.
LATE = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "GLOO_SOCKET_IFNAME", "SLURM_JOB_ID", "SLURMFT_JOB_ID",
    "SLURMD_NODENAME", "SLURMFT_RUN_DIR", "SLURMFT_NODE_SILENT_S", "SLURMFT_CKPT_FAULT",
    "SLURMFT_CKPT_FAULT_MARK", "SLURMFT_CKPT_FAULT_DELAY", "PYTEST_CURRENT_TEST",
})
LANES = 2
# Besides the server's defaults (torch, torch.distributed, DCP, slurmft.train.run): what the
# tests' rank scripts import, ~1 s more per rank otherwise.
IMPORTS = ("numpy", "torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict",
           "torch.nn.parallel", "slurmft.checkpoint.manager")
MAX_SERVERS = 6
# A liveness bound for a server's imports (torch, DCP, dynamo...: 5-10 s on the quiet box, over a
# minute at load 30), waited before the ranks start, so that their own bounds do not include it.
READY_S = 600.0
FIND_POLL_S = 0.02
# The server dies with the thread that started it, before it imports anything of its own.
_LAUNCH = ("import ctypes, os, signal, sys\n"
           "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
           "if os.getppid() != int(sys.argv[1]):\n"
           "    sys.exit('the test process that started this warm server is gone')\n"
           "os.execv(sys.executable, [sys.executable, '-m', 'slurmft.launch.warm', *sys.argv[2:]])\n")


class _Server:
    def __init__(self, env: Mapping[str, str], log_dir: str, name: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="slurmft-wr-", dir="/tmp")   # 0700, short: sun_path is 108 bytes
        self.path = os.path.join(self.dir, "s")
        _, defaults = warm.settings({})
        imports = ",".join(dict.fromkeys((*defaults, *IMPORTS)))
        self.log = os.path.join(log_dir, f"{name}.log")
        self.env = dict(env)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, str(os.getpid()), "--socket", self.path, "--imports", imports],
                env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

        self.ready = False

    def wait_ready(self, timeout: float = READY_S) -> None:
        """Until the server has imported and forks: one empty rank (``/dev/null``) through it.
        A server that cannot warm answers at once (its clients run cold): said on stderr."""
        if self.ready:
            return
        probe = subprocess.Popen(warm.worker_command(["/dev/null"]), env={**self.env, warmclient.SOCKET_ENV: self.path},
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = probe.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.wait(timeout=30)
            raise AssertionError(f"the warm server {self.log} did not start forking within {timeout:.0f} s "
                                 "(importing torch on a loaded box?)") from None
        if b"starting this rank cold" in err:
            print(f"warm_ranks: {err.decode(errors='replace').strip()} (server log {self.log})", file=sys.stderr)
        self.ready = True

    def stop(self) -> None:
        warmtask.stop_server(self.proc, self.path)
        shutil.rmtree(self.dir, ignore_errors=True)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _watches(worker: int, client: int) -> bool:
    """Whether ``worker`` holds a pidfd of ``client`` (warmworker's watch of its client)."""
    try:
        fds = os.listdir(f"/proc/{worker}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{worker}/fd/{fd}") != "anon_inode:[pidfd]":
                continue
            info = Path(f"/proc/{worker}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        if f"\nPid:\t{client}\n" in info:
            return True
    return False


def _ran_cold(pid: int) -> bool:
    """The client exec'd its rank cold. (Its command line reads empty for a moment after
    an exec: that is not known yet, nor is a process that is gone.)"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return bool(cmdline) and warmclient.__file__.encode() not in cmdline


class WarmRanks:
    """The pytest process's warm servers, and the ranks started through them."""

    def __init__(self) -> None:
        self.log_dir = tempfile.mkdtemp(prefix="slurmft-warm-ranks-")
        self.servers: dict[tuple[tuple[tuple[str, str], ...], int], _Server] = {}
        self.count = 0

    def server_for(self, env: Mapping[str, str], rank: int) -> _Server:
        import_env = {k: v for k, v in env.items() if k not in LATE}
        key = (tuple(sorted(import_env.items())), rank % LANES)
        server = self.servers.pop(key, None)
        if server is not None and server.proc.poll() is not None:
            server.stop()
            server = None
        if server is None:
            while len(self.servers) >= MAX_SERVERS:   # the least recently used one
                self.servers.pop(next(iter(self.servers))).stop()
            self.count += 1
            server = _Server(import_env, self.log_dir, f"server{self.count}-lane{key[1]}")
        self.servers[key] = server   # most recently used last
        return server

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str], rank: int = 0,
              **kwargs: object) -> subprocess.Popen:
        """What ``subprocess.Popen(argv, env=env, **kwargs)`` would start, ``argv`` being
        ``[sys.executable, SCRIPT | -m MODULE, ARGS...]``, forked from a warm server instead.
        ``rank`` picks the lane (any int: ranks of one world should differ)."""
        if not argv or argv[0] != sys.executable or len(argv) < 2 or argv[1].startswith("-") and argv[1] != "-m":
            raise ValueError(f"a warm rank is [sys.executable, SCRIPT | -m MODULE, ...], not {list(argv)!r}")
        server = self.server_for(env, rank)
        server.wait_ready()
        client_env = {**env, warmclient.SOCKET_ENV: server.path}
        return subprocess.Popen(warm.worker_command(list(argv[1:])), env=client_env, **kwargs)  # type: ignore[call-overload]

    def worker_pid(self, proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
        """The rank's own pid: the forked worker, or the client itself once it runs the rank
        cold; None when the client ended first or nothing was forked within ``timeout``."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if _ran_cold(proc.pid):
                return proc.pid
            for server in self.servers.values():
                for child in _children(server.proc.pid):
                    if _watches(child, proc.pid):
                        return child
            if time.monotonic() > deadline:
                return None
            time.sleep(FIND_POLL_S)
        return None

    def send_signal(self, proc: subprocess.Popen, sig: int, timeout: float = 30.0) -> None:
        """``sig`` to the rank itself (SIGSTOP stops the rank, not its client)."""
        pid = self.worker_pid(proc, timeout)
        if pid is None:
            raise AssertionError(f"rank client {proc.pid} has no warm worker after {timeout:.0f} s "
                                 f"(exit {proc.poll()}); server logs in {self.log_dir}")
        os.kill(pid, sig)

    def kill_all(self, procs: Sequence[subprocess.Popen]) -> None:
        """SIGKILL every rank at this moment (the workers first, found before any is killed,
        then their clients), and reap the clients."""
        live = [p for p in procs if p.poll() is None]
        workers = [self.worker_pid(p, timeout=0) for p in live]
        for pid in workers:
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in live:   # a client whose worker was not forked yet: nothing of the rank ran
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait(timeout=30)

    def kill(self, proc: subprocess.Popen) -> None:
        self.kill_all([proc])

    def prewarm(self, env: Mapping[str, str]) -> None:
        """Start every lane's server for ``env`` (side by side) and wait until they fork."""
        for server in [self.server_for(env, lane) for lane in range(LANES)]:
            server.wait_ready()

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
        shutil.rmtree(self.log_dir, ignore_errors=True)


_POOL: list[WarmRanks] = []   # this process's pool, once started
_ERRORS: list[BaseException] = []


def _pool() -> WarmRanks:
    if not _POOL:
        _POOL.append(WarmRanks())
    return _POOL[0]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Before the first test that uses ranks, its servers are started outside that test's timeout
    (this wrapper is outside pytest-timeout's, as tests/conftest.py's devcluster start): the
    imports have their own bound, and a test's bound is for its ranks. The environment is the
    one the rank tests start from (theirs plus per-rank variables read late)."""
    del nextitem
    if "warm_ranks" in getattr(item, "fixturenames", ()) and not _ERRORS:
        try:
            _pool().prewarm({**os.environ, "OMP_NUM_THREADS": "1"})
        except Exception as exc:   # the test's own popen waits again and fails with it
            _ERRORS.append(exc)
    yield


@pytest.fixture(scope="session")
def warm_ranks() -> WarmRanks:
    return _pool()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The servers are stopped here, outside every test's timeout. As the session fixture's
    teardown they were stopped under the worker's last test's bound (10 s for a unit test), and
    a fresh-clone run at load 18-30 failed three such teardowns (ERROR at teardown of whichever
    test came last) while the servers took longer than that to end."""
    del session, exitstatus
    if _POOL:
        _POOL.pop().close()
