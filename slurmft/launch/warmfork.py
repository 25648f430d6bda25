"""A node's warm server forked from torchrun's agent: one ``import torch`` per node start.

The agent (``agent``, a spare's ``pretorchrun``) imports torch and torchrun's elastic agent
(``torch.distributed.run``, ~2 CPU-s) before it can do anything. When the node's task asks it to
serve (``SERVE_ENV``: the socket's path in the task's private directory, ``warmtask.make_dir``),
it imports them as the server would (``FORK_SAFE_ENV``: OpenBLAS without its thread pool, CUDA
asked through NVML; the environment restored afterwards, so torchrun's workers get the task's),
binds the socket, and forks while it is still one thread: the child is the node's warm server
(``warm.run``: it imports the rest of what a rank imports, DCP, dynamo and ``slurmft.train.run``,
while the agent goes on to the rendezvous, then serves); the parent closes its copy of the
socket and runs torchrun. At torchrun's end the agent TERMs its server and reaps it (KILL after
``STOP_WAIT_S``). A server whose agent died (KILL) is TERMed by the kernel
(``PR_SET_PDEATHSIG``): it forks no more and ends once its workers have.

Where the agent already runs a thread at that point (a site's ``sitecustomize``, a module that
starts one at import), a fork is unsafe: the server is started as a process of its own
(``python -m slurmft.launch.warm``, as before this module) and pays its own import of torch.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import MutableMapping, Sequence

from slurmft.launch import scriptend, warm, warmtask

SERVE_ENV = "SLURMFT_WARM_SERVE"
FORK_SAFE_ENV = {"OPENBLAS_NUM_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
STOP_WAIT_S = 10.0
_POLL_S = 0.05


@dataclass
class ServerChild:
    pid: int
    proc: subprocess.Popen | None = None   # the fallback's: a process of its own


def import_for_fork(module: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """Import ``module`` as the warm server's ``prepare`` would (``FORK_SAFE_ENV`` set for the
    import only). An import that fails is not reported here: torchrun's own start fails the same
    way, with the same traceback."""
    saved = {name: environ.get(name) for name in FORK_SAFE_ENV}
    for name, value in FORK_SAFE_ENV.items():
        environ.setdefault(name, value)
    try:
        importlib.import_module(module)
    except Exception:   # noqa: BLE001  (reported by torchrun's own start; a signal's is not caught)
        pass
    finally:
        for name, before in saved.items():
            if before is None:
                environ.pop(name, None)
            else:
                environ[name] = before


_threads = warm.native_threads


def start(environ: MutableMapping[str, str] = os.environ,
          not_inherited: Sequence[int] = ()) -> ServerChild | None:
    """The node's server, when the task asked for one (``SERVE_ENV``, taken out of the
    environment: torchrun's workers are clients, not servers); None otherwise or when it cannot
    be started (the clients then run their ranks cold, each saying why). ``not_inherited``: fds
    of the agent's that the server (and so every rank it forks) must not hold."""
    path = environ.pop(SERVE_ENV, None)
    if not path:
        return None
    imports: tuple[str, ...] = warm.DEFAULT_IMPORTS
    try:
        _, imports = warm.settings(environ)
    except warm.WarmSettingsError:   # refused by the launcher at the start: a hand-made environment
        pass
    if threading.active_count() != 1 or _threads() != 1:
        return _start_apart(path, imports, environ)   # Popen closes the agent's other fds
    try:
        sock = warm.listen(path)
    except OSError as exc:
        _say(f"cannot listen on {path}: {exc}")
        return None
    parent = os.getpid()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
    except OSError as exc:   # EAGAIN (a pids limit), ENOMEM: the node's ranks start cold
        sock.close()
        _say(f"cannot fork the warm server: {exc}")
        return None
    if pid == 0:   # the server; never returns into the agent's frames
        code = 1
        try:
            warm.die_with(parent)
            for fd in not_inherited:
                os.close(fd)
            code = warm.run(warm.Server(path, sock), imports)
        except BaseException:   # noqa: BLE001
            traceback.print_exc()
        scriptend.finish(code)
    sock.close()
    return ServerChild(pid)


def _start_apart(path: str, imports, environ) -> ServerChild | None:
    _say(f"{_threads()} threads already run here: the warm server starts as a process of its own")
    try:
        proc = subprocess.Popen(warm.server_argv(path, imports, parent=os.getpid()),
                                env=dict(environ))
    except OSError as exc:
        _say(f"cannot start the warm server: {exc}")
        return None
    return ServerChild(proc.pid, proc)


def stop(server: ServerChild | None, wait_s: float = STOP_WAIT_S) -> None:
    """TERM the server, wait ``wait_s`` for it (it waits for its workers), then KILL it and wait
    as long again; reaped. Never raises: it runs as the agent ends, whose status is torchrun's."""
    if server is None:
        return
    if server.proc is not None:
        warmtask.stop_process(server.proc, wait_s)
        return
    try:
        os.kill(server.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline, killed = time.monotonic() + wait_s, False
    while True:
        try:
            done, _ = os.waitpid(server.pid, os.WNOHANG)
        except ChildProcessError:   # reaped already
            return
        if done:
            return
        if time.monotonic() >= deadline:
            if killed:   # unkillable (blocked in the kernel: a hung filesystem): not waited on
                _say(f"the warm server {server.pid} did not end after its KILL: left")
                return
            _say(f"the warm server {server.pid} did not end {wait_s:g} s after its TERM: killed")
            try:
                os.kill(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            killed, deadline = True, time.monotonic() + wait_s
        time.sleep(_POLL_S)


def _say(msg: str) -> None:
    print(f"slurmft.launch.agent: {msg}", file=sys.stderr, flush=True)
