"""The warm server's fork becoming a rank (``slurmft.launch.warm``, issue 27): what a cold start
of ``python -u SCRIPT`` / ``python -u -m MODULE`` would have given the process, applied to a fork
of a server that already imported torch; and its end (``run``): what the interpreter does when a
script ends, then ``os._exit`` instead of the interpreter's teardown (``scriptend``). With torch
loaded that teardown costs ~0.9 CPU-s per rank and writes nothing the rank asked for: the rank's
own exit paths (the checkpoint manager's close, the journal's buffered events) are ``atexit``
handlers, which run."""

from __future__ import annotations

import ctypes
import os
import signal
import select
import sys
import threading
import time
from typing import Collection, Mapping, NoReturn

from slurmft.launch import scriptend
from slurmft.launch import warmclient as proto

WATCH_POLL_S = 0.5
_PR_SET_NAME = 15


def name_process(name: str) -> None:
    """Set this process's command name (``/proc/PID/comm``, 15 bytes): a node's warm server is
    found by its own (``warm.is_server``: forked from torchrun's agent, its command line is the
    agent's), and a worker forked from it takes back the one a cold rank would have."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch_client(pid: int) -> None:
    """The client is gone: this worker and its process group go with it. A pidfd (no pid reuse
    race), else ``kill(pid, 0)`` every WATCH_POLL_S."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    else:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            time.sleep(WATCH_POLL_S)
    os.killpg(0, signal.SIGKILL)


def _stdio() -> None:
    import io
    enc = sys.stdout.encoding if sys.stdout else "utf-8"
    streams = {
        "stdin": io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=enc),
        "stdout": io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=enc,
                                   write_through=True, line_buffering=True),
        "stderr": io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=enc,
                                   errors="backslashreplace", write_through=True,
                                   line_buffering=True)}
    for name, stream in streams.items():   # -u, as torchrun starts a rank
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _threads(env: Mapping[str, str]) -> None:
    """OpenMP read ``OMP_NUM_THREADS`` when the server loaded it; a rank's cold start reads the
    rank's (torchrun sets 1 when a node runs several): apply it as that start would have."""
    torch = sys.modules.get("torch")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        raw = (env.get(name) or "").split(",")[0].strip()
        if raw.isdigit() and int(raw) > 0 and torch is not None:
            torch.set_num_threads(int(raw))
            return


def become_worker(req: dict, client_pid: int, mask: Collection[int] | None = None) -> None:
    """In the fork: set up the rank's process as its own interpreter would be, and run it.
    Whatever the script raises unwinds to the top of this interpreter, which ends as usual.
    ``mask``: the signal mask to restore once the rank's dispositions are set (the server forks
    with the relayed signals blocked: one relayed meanwhile is delivered then, to the rank)."""
    import runpy
    import types

    os.setsid()
    name_process(os.path.basename(sys.executable))
    ignored = set(req.get("ignored", []))
    for sig in proto.RELAYED:
        if sig == signal.SIGINT and sig not in ignored:
            signal.signal(sig, signal.default_int_handler)
        else:
            signal.signal(sig, signal.SIG_IGN if int(sig) in ignored else signal.SIG_DFL)
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    _stdio()
    _threads(os.environ)
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    threading.Thread(target=_watch_client, args=(client_pid,), name="slurmft-warm-client", daemon=True
                     ).start()
    argv = req["argv"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    main_mod = types.ModuleType("__main__")
    sys.modules["__main__"] = main_mod
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0:1] = [os.getcwd(), *[p for p in extra if p not in sys.path]]
        runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0:1] = [os.path.dirname(os.path.realpath(script)),
                     *[p for p in extra if p not in sys.path]]
    try:
        with open(script, "rb") as f:
            source = f.read()
    except OSError as exc:   # as the interpreter says it, and its exit status
        print(f"{sys.executable}: can't open file {script!r}: [Errno {exc.errno}] {exc.strerror}",
              file=sys.stderr)
        raise SystemExit(2) from None
    from importlib.machinery import SourceFileLoader
    main_mod.__dict__.update({"__file__": script, "__cached__": None, "__spec__": None,
                              "__builtins__": __builtins__, "__package__": None,
                              "__loader__": SourceFileLoader("__main__", script)})
    exec(compile(source, script, "exec"), main_mod.__dict__)


def run(req: dict, client_pid: int, mask: Collection[int] | None = None) -> NoReturn:
    """Become the rank (``become_worker``), run it, and end the process as the interpreter ends a
    script, without its teardown (``scriptend``). Never returns."""
    scriptend.run_as_script(lambda: become_worker(req, client_pid, mask))
