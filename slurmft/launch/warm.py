"""Pre-started ("warm") workers (issue 27; on by default in both modes since 2026-11-28,
``SLURMFT_WARM_WORKERS=0`` opts out).

Every start of the ranks (a job's start or requeue, a restart inside the allocation) would make
each rank pay a cold start (``import torch`` and the script's imports: most of a restart,
docs/performance.md). Instead each node has one warm server, forked from torchrun's agent after
the agent's own import of torch (``warmfork``; or ``python -m slurmft.launch.warm --socket PATH``,
a process of its own, where the agent cannot fork): its Unix socket is bound first (a 0700
directory the node's task made; a peer of another uid is refused), then it imports what every
slurmft rank imports (``DEFAULT_IMPORTS``) and ``SLURMFT_WARM_IMPORTS``,
checks that nothing started a thread or initialised CUDA (torch's own flag, and a CUDA driver
library ``libcuda.so*`` mapped in the process must say it was not initialised: a module may call
the driver without torch, :mod:`slurmft.launch.cudafork`; forking then would be unsafe: it refuses
every client, which runs its rank cold, one log line), moves what it imported out of the
collector's reach (``gc.freeze``), and serves. It names itself ``SERVER_NAME`` (its command line
is the agent's: ``is_server`` finds it). torchrun's worker command is the torch-free
client (``slurmft.launch.warmclient``); per client the server forks a worker that

  becomes the rank: its own session (torchrun signals a worker's process group), the client's
  fds 0-2, cwd, environment, argv and ignored signals; ``sys.path[0]`` as the interpreter sets
  it; ``random``/``numpy.random`` reseeded (a fork shares its parent's state); stdio unbuffered
  (torchrun runs ranks with ``-u``); then runs the script or ``-m`` module as ``__main__`` and
  ends as an interpreter does (traceback and 1, SystemExit's code, non-daemon threads joined,
  atexit, flush), then ``os._exit`` without the interpreter's teardown (``warmworker.run``);
  dies with its client: the server watches the client's socket and a thread in the worker the
  client's pid (``SO_PEERCRED``, a pidfd); its end (the client killed -9 by torchrun's stop)
  kills the worker's process group. The server's death closes the client's socket: the client
  kills its worker (nobody could reap it and pass its status on) and exits 1.

A client may ask the server to kill its worker (``warmclient.KILL_REQUEST``): torchrun stopped it
for a restart and it is frozen or did not end (``warmclient.StopWatch``); the server kills its
process group and journals no crash for it (a stop, like torchrun's own KILL). The task marks its
node stopping (``warmtask.mark_stopping``) before it passes a TERM or INT on to torchrun, so
that a real stop keeps torchrun's bound.

A TERM (Slurm's to the whole step: a preemption, ``scancel``; the agent's at torchrun's end; the
kernel's when the agent died), or an INT, HUP or QUIT, stops the server forking; it exits once
its workers ended, as their ranks and clients decide (they save first: a server that killed them
at its TERM cut a preemption's emergency checkpoint). Before it serves, such a signal ends it at
once (its imports are not finished for nobody).

The server reaps each worker and sends its status to its client, which exits with it; a crash
(``rankexit``'s rule) it also journals as ``rank_exit`` at once, for the launcher. What a
fork cannot give a rank: environment variables read by torch or the pre-imported modules *at
import* take the task's values (torchrun's per-rank variables are all read later), and the
modules are the ones on the node when the server started.

The task's side (the server's directory, marking the node stopping, and removing what a killed
task left) is ``warmtask``, the agent's (forking and stopping it) ``warmfork``;
``worker_command`` is what the launcher puts after torchrun's ``--no-python``.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import gc
import importlib
import os
import re
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
from pathlib import Path
from typing import Mapping, Sequence

from slurmft.launch import rankexit
from slurmft.launch.cudafork import cuda_driver_mapped, cuda_fork_problem  # noqa: F401 (tests use the first)
from slurmft.launch import warmclient as proto
from slurmft.launch import scriptend, warmworker

ENABLE_ENV = "SLURMFT_WARM_WORKERS"
IMPORTS_ENV = "SLURMFT_WARM_IMPORTS"
# What every slurmft rank imports (``slurmft.train.run`` pulls DCP in; torch imports
# ``torch._dynamo`` lazily on the FSDP/DCP path: ~1 s each, measured after the fork otherwise).
DEFAULT_IMPORTS = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo",
                   "slurmft.train.run")
_PR_SET_PDEATHSIG = 1
SERVER_NAME = "slurmft-warm"   # its /proc/PID/comm (``warmworker.name_process``)
REQUEST_READ_S = 10.0
REAP_POLL_S = 0.2
STAGING_SUFFIX = "~"        # the socket's name while it is bound but not yet listening
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class WarmSettingsError(ValueError):
    pass


def settings(env: Mapping[str, str]) -> tuple[bool | None, tuple[str, ...]]:
    """(asked for: True for 1, False for 0, None when unset; the modules to pre-import) from the
    environment; a bad value names its variable. Unset means on (``settings.LaunchSettings``;
    the launcher passes its decision to the tasks in torchrun's worker command: ``serves``)."""
    flag = (env.get(ENABLE_ENV) or "").strip()
    if flag not in ("", "0", "1"):
        raise WarmSettingsError(f"{ENABLE_ENV}={flag!r} must be 0 or 1")
    try:
        proto.stop_grace_s(env)
    except ValueError as exc:
        raise WarmSettingsError(str(exc)) from None
    extra = []
    for name in (env.get(IMPORTS_ENV) or "").split(","):
        name = name.strip()
        if not name:
            continue
        if not _MODULE.match(name):
            raise WarmSettingsError(f"{IMPORTS_ENV}: {name!r} is not a module name")
        extra.append(name)
    return (None if not flag else flag == "1"), tuple(dict.fromkeys((*DEFAULT_IMPORTS, *extra)))


def server_argv(path: str, imports: Sequence[str], python: str = sys.executable,
                parent: int | None = None) -> list[str]:
    """The command of a server started as a process of its own (``main``)."""
    return [python, "-m", "slurmft.launch.warm", "--socket", path, "--imports", ",".join(imports),
            *(["--parent", str(parent)] if parent is not None else [])]


def worker_command(command: Sequence[str], python: str = sys.executable) -> list[str]:
    """torchrun's worker after ``--no-python``: the client, by path, isolated and site-free."""
    return [python, "-I", "-S", proto.__file__, "--", *command]


def serves(torchrun_argv: Sequence[str]) -> bool:
    """Whether torchrun's workers are warm clients (``worker_command``): the node task then asks
    torchrun's agent for a server (``warmfork``). The launcher's argv is the one decision
    (``SLURMFT_WARM_WORKERS``)."""
    return proto.__file__ in torchrun_argv


# -- the server ----------------------------------------------------------------------------------

class _StoppedEarly(BaseException):
    """A stop signal while the server still imports: it ends without serving."""


class _BecomeWorker(BaseException):
    """Raised in a fresh fork: unwinds the server's frames to ``main``, which runs the rank."""

    def __init__(self, request: dict, client_pid: int, mask: set) -> None:
        super().__init__()
        self.request, self.client_pid, self.mask = request, client_pid, mask


def _log(msg: str) -> None:
    print(f"slurmft warm server[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def native_threads() -> int:
    """This process's threads as the kernel counts them (a library's native ones too)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def prepare(imports: Sequence[str]) -> str | None:
    """Import the modules; None when forking is safe afterwards, else why not."""
    # numpy's OpenBLAS (imported by torch) starts its thread pool at load unless told one thread
    # (torchrun's ranks get OMP_NUM_THREADS=1, which OpenBLAS reads too, when a node has several).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # A module asking torch.cuda.is_available() at import would cuInit this process, and a forked
    # child cannot use CUDA after that: ask NVML instead (torch's documented switch for forks).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for name in imports:
        try:
            importlib.import_module(name)
        except Exception as exc:   # any import error: no warm workers on this node
            return f"import {name} failed: {type(exc).__name__}: {exc}"
    if threading.active_count() != 1 or native_threads() != 1:
        return (f"the imports started threads ({threading.active_count()} Python, "
                f"{native_threads()} native): forking would be unsafe")
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "the imports initialised CUDA: a forked worker could not use it"
    return cuda_fork_problem()


def _validate(req: dict, fds: list[int]) -> str | None:
    if req.get("version") != proto.VERSION:
        return f"protocol version {req.get('version')!r}, expected {proto.VERSION}"
    argv, env, cwd = req.get("argv"), req.get("env"), req.get("cwd")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        return "argv is not a non-empty list of strings"
    if argv[0] == "-m" and len(argv) < 2:
        return "-m without a module"
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                          for k, v in env.items())):
        return "env is not a mapping of strings"
    if not isinstance(cwd, str) or not isinstance(req.get("client_pid"), int):
        return "cwd or client_pid missing"
    ignored = req.get("ignored", [])
    if not (isinstance(ignored, list) and all(isinstance(s, int) for s in ignored)):
        return "ignored is not a list of signal numbers"
    if len(fds) != 3:
        return f"{len(fds)} fds instead of stdin, stdout, stderr"
    return None


def listen(path: str) -> socket.socket:
    """The server's listening socket at ``path``, in a directory private to the node's task
    (``warmtask.make_dir``). A socket left there by a server that died (nobody accepts on it) is
    replaced; a live server's, or anything not a socket, is an OSError naming the path."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass
        else:
            raise OSError(errno.EADDRINUSE, f"a warm server already listens at {path}")
        finally:
            probe.close()
        os.unlink(path)
    # Bound and listening under a name of its own, then renamed into place: a client polling
    # for ``path`` (``warmclient._connect``) would take the refusal of a socket bound but not yet
    # listening for a dead server's and start its rank cold.
    staging = path + STAGING_SUFFIX
    try:
        os.unlink(staging)   # one a server that died between its bind and rename left
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(staging)
        sock.listen(64)
        os.rename(staging, path)
    except BaseException:
        sock.close()
        try:
            os.unlink(staging)
        except OSError:
            pass
        raise
    return sock


def _identity(path: str) -> tuple[int, int, int] | None:
    """The file at ``path`` (an inode number is reused at once: its change time tells a later
    socket of the same number apart)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def die_with(parent: int) -> None:
    """Be TERMed by the kernel when ``parent`` (this process's parent, the agent) ends
    (``PR_SET_PDEATHSIG``: asked from this process's only thread, so it is about the parent's
    end, not a thread's); a parent already gone TERMs at once."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def is_server(pid: int | str) -> bool:
    """Whether ``pid`` is a node's warm server (forked from its agent, or started on its own)."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip() == SERVER_NAME.encode()
    except OSError:
        return False


class Server:
    def __init__(self, path: str, sock: socket.socket | None = None) -> None:
        self.path = path
        self.pid = os.getpid()
        self.sock = listen(path) if sock is None else sock
        self.ident = _identity(path)   # close() removes this socket only, never a later server's
        self.sel = selectors.DefaultSelector()
        self.workers: dict[int, socket.socket] = {}   # pid -> its client's connection
        self.envs: dict[int, dict] = {}     # pid -> its rank's environment (``rankexit``)
        self.killed: set[int] = set()       # killed here: their clients were gone
        self.stopping = False
        self.refusing: str | None = None   # why this node has no warm workers

    def close(self) -> None:
        if os.getpid() != self.pid:   # a worker unwinding through the server's frames
            return
        for pid in list(self.workers):
            self._kill(pid)
        self.sock.close()
        if self.ident is not None and _identity(self.path) == self.ident:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def serve(self) -> None:
        """Serve until a TERM (``stopping``), then, forking no more, until every worker ended:
        Slurm's TERM to a step (a preemption, ``scancel``) reaches this server with the ranks it
        forked, which save before they exit; their end stays theirs and their clients'."""
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        listening = True
        while not (self.stopping and not self.workers):
            if self.stopping and listening:
                listening = False
                self.sel.unregister(self.sock)
                self.sock.close()
                if self.workers:
                    _log(f"TERM: no new workers; waiting for {len(self.workers)} to end")
            for key, _ in self.sel.select(REAP_POLL_S):
                if key.data is None:
                    self._accept()
                else:
                    self._client_readable(key.data, key.fileobj)
            self._reap()

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer_pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            _log(f"refused a client of uid {uid}")
            conn.close()
            return
        conn.settimeout(REQUEST_READ_S)
        try:
            req, fds = proto.recv_request(conn)
        except (OSError, ValueError, proto.ProtocolError) as exc:
            _log(f"a bad request: {exc}")
            conn.close()
            return
        problem = self.refusing or _validate(req, fds)
        if problem is not None:
            self._refuse(conn, fds, problem)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        # The relayed signals stay blocked in the fork until it is in its own session with the
        # rank's dispositions (warmworker): a signal its client relays at once (a TERM that came
        # while it waited for the fork) is then the rank's, not lost to the server's handler.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, proto.RELAYED)
        try:
            pid = os.fork()
        finally:
            if os.getpid() == self.pid:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if pid == 0:
            # Closed through their objects, never by number: an object whose fd was closed
            # behind its back closes that number again when it is collected (at the rank's exit,
            # the server's frames are a cycle), and by then the number is the rank's: a gloo
            # socket or epoll fd (a save in flight stuck, gloo's abort, a hung teardown).
            self.sel.close()
            self.sock.close()
            for client in self.workers.values():
                client.close()
            os.dup2(fds[0], 0)
            os.dup2(fds[1], 1)
            os.dup2(fds[2], 2)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            conn.close()   # the server's end only: the client sees EOF once the server is gone
            raise _BecomeWorker(req, peer_pid, mask)
        for fd in fds:
            os.close(fd)
        env = req["env"]
        _log(f"rank {env.get('RANK', '?')} (attempt {env.get('TORCHELASTIC_RESTART_COUNT', '0')}) "
             f"forked warm as pid {pid}")
        self.workers[pid], self.envs[pid] = conn, env
        try:
            conn.sendall(proto.reply(b"P", pid))
        except OSError:   # the client is gone already
            self._kill(pid)
        self.sel.register(conn, selectors.EVENT_READ, pid)

    def _refuse(self, conn: socket.socket, fds: list[int], why: str) -> None:
        for fd in fds:
            os.close(fd)
        _log(f"refused a request: {why}")
        try:
            conn.sendall(proto.reply(b"E", why))
        except OSError:
            pass
        conn.close()

    def _client_readable(self, pid: int, conn) -> None:
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if not data:   # the client died: its worker goes with it
            self.sel.unregister(conn)
            self._kill(pid)
        elif proto.KILL_REQUEST in data and pid not in self.killed:
            _log(f"pid {pid} killed at its client's word: torchrun stopped it and it did not end")
            self._kill(pid)

    def _kill(self, pid: int) -> None:
        self.killed.add(pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            env = self.envs.pop(pid, None)
            if conn is None:
                continue
            if pid not in self.killed and env is not None:  # the moment a rank crashed (journaled)
                rankexit.record(env, os.waitstatus_to_exitcode(status), pid, _log)
            self.killed.discard(pid)
            try:
                self.sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            try:
                conn.sendall(proto.reply(b"X", os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            conn.close()


def run(server: Server, imports: Sequence[str]) -> int:
    """Import ``imports``, then serve until a TERM and the last worker's end (``Server.serve``).
    In a fork that becomes a rank it never returns (``warmworker.run``)."""
    warmworker.name_process(SERVER_NAME)
    serving = False

    def stop(signum: int, frame: object) -> None:
        # A stop before any worker exists ends the imports too (a torchrun that failed at once,
        # a spare never activated); after, the server drains: its workers' ends are theirs.
        server.stopping = True
        if not serving:
            raise _StoppedEarly()

    # INT, HUP and QUIT are stops like TERM (Slurm's ``scancel --signal``, srun's Ctrl-C): the
    # interpreter's own INT would unwind ``serve`` and kill every worker before it could save.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, stop)
    worker: _BecomeWorker | None = None
    try:
        problem = prepare(imports)
        if problem is not None:   # every client is answered at once, and runs its rank cold
            _log(f"no warm workers on this node: {problem}")
            server.refusing = problem
        else:
            # What every fork inherits (torch's ~170k objects) leaves the collector's reach: a
            # worker's collections and its end's scan for open files (``scriptend``) would walk
            # it all, ~0.15 CPU-s per rank and each full collection, and dirty every page it
            # touches (copy-on-write). The gc module's own advice for fork without exec.
            gc.freeze()
        serving = True
        server.serve()
    except _BecomeWorker as become:
        worker = become
    except _StoppedEarly:
        _log("stopped before it served")
    finally:
        server.close()
    if worker is not None:   # outside the handler: the rank's own errors carry no server context
        warmworker.run(worker.request, worker.client_pid, worker.mask)   # never returns
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The server as a process of its own (``warmfork``'s fallback, the tests): bound first,
    clients wait in the backlog while it imports."""
    parser = argparse.ArgumentParser(prog="python -m slurmft.launch.warm")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--imports", default=",".join(DEFAULT_IMPORTS))
    parser.add_argument("--parent", type=int, default=None,
                        help="end (TERM) when this process, the server's parent, ends")
    args = parser.parse_args(argv)
    if args.parent is not None:
        die_with(args.parent)
    if not Path(args.socket).parent.is_dir():
        _log(f"no directory for the socket {args.socket}")
        return 2
    try:
        server = Server(args.socket)
    except OSError as exc:
        _log(f"cannot listen: {exc}")
        return 2
    return run(server, [m for m in args.imports.split(",") if m])


if __name__ == "__main__":
    # The server's end, as a worker's: without the interpreter's teardown of torch (~1 CPU-s per
    # node and job step; it has nothing left to write: each worker's end was journaled as reaped).
    scriptend.finish(main())
