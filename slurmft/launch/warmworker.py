"""The warm server's fork becoming a rank (``slurmft.launch.warm``, issue 27): what a cold start
of ``python -u SCRIPT`` / ``python -u -m MODULE`` would have given the process, applied to a fork
of a server that already imported torch; and its end (``run``): what the interpreter does when a
script ends (traceback and 1, SystemExit's code, non-daemon threads joined, atexit, stdio
flushed, an unhandled KeyboardInterrupt dying of SIGINT), then ``os._exit`` instead of the
interpreter's teardown. With torch loaded that teardown (every module and object freed, C++
destructors) costs ~0.9 CPU-s per rank and writes nothing the rank asked for: the rank's own
exit paths (the checkpoint manager's close, the journal's buffered events) are ``atexit``
handlers, which run. It is what ``multiprocessing`` does with its own forked children; files the
script left open and unflushed are flushed first, as their teardown would have."""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import signal
import select
import sys
import threading
import time
import traceback
from typing import Collection, Mapping, NoReturn

from slurmft.launch import warmclient as proto

WATCH_POLL_S = 0.5


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
    script, without its teardown (module docstring). Never returns."""
    code, interrupted = 0, False
    try:
        become_worker(req, client_pid, mask)
    except SystemExit as exc:
        code = _system_exit_code(exc)
    except BaseException as exc:   # as PyErr_Print: the hook prints it, the process exits 1
        interrupted = isinstance(exc, KeyboardInterrupt)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        try:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        except BaseException:
            traceback.print_exception(exc)
        code = 1
    finish(code, interrupted)


def _system_exit_code(exc: SystemExit) -> int:
    """The exit status the interpreter gives an uncaught SystemExit (``_Py_HandleSystemExit``)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code if -2**31 <= code < 2**31 else 255   # C's int, as PyLong_AsLong's -1
    try:
        print(code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def finish(code: int, interrupted: bool = False) -> NoReturn:
    """Py_FinalizeEx's part that the process's work can see, in its order, then ``os._exit``
    (also the warm server's own end: it has torch loaded too)."""
    try:
        threading._shutdown()   # type: ignore[attr-defined]  # non-daemon threads joined
    except BaseException as exc:
        traceback.print_exception(exc)
    atexit._run_exitfuncs()
    _flush_open_files()
    try:
        ctypes.CDLL(None).fflush(None)   # C stdio buffers a native library wrote to
    except (OSError, AttributeError):
        pass
    if interrupted:   # as the interpreter ends on an unhandled KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _flush_open_files() -> None:
    """Flush every writable file object still open (stdio first): the teardown would have, as it
    closed each one."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:
            pass
    kinds = {io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper}   # what open() returns
    for obj in gc.get_objects():
        if type(obj) in kinds:   # not isinstance: it reads __class__, which some shims warn on
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except BaseException:
                pass
