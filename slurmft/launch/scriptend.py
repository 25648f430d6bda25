"""A process's end as the interpreter ends a script, without the interpreter's teardown.

``run_as_script(body)`` runs ``body`` as the top of a script would run, and ends the process as
CPython does at a script's end: an uncaught exception printed by ``sys.excepthook`` (status 1),
SystemExit's code (``_Py_HandleSystemExit``), non-daemon threads joined, the ``atexit`` handlers
(``weakref.finalize`` ones included), every writable file object and C stdio flushed, an
unhandled KeyboardInterrupt dying of SIGINT; then ``os._exit`` (``finish``) instead of the
teardown (every module and object freed, C++ static destructors). With torch loaded that
teardown costs ~0.5-1.2 CPU-s and writes nothing the process asked for. ``multiprocessing``
ends its own forked children the same way. Used by the warm ranks and their server
(``warmworker``, ``warm``) and by torchrun's agent as slurmft starts it (``agent``,
``pretorchrun``). What it no longer does: finalizers (``__del__``) of objects still alive at the
end do not run (docs/limitations.md).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import signal
import sys
import threading
import traceback
from typing import Callable, NoReturn


def run_as_script(body: Callable[[], object]) -> NoReturn:
    """Run ``body`` as a script's top level and end the process as the interpreter would end it,
    without its teardown. Never returns."""
    code, interrupted = 0, False
    try:
        body()
    except SystemExit as exc:
        code = system_exit_code(exc)
    except BaseException as exc:   # as PyErr_Print: the hook prints it, the process exits 1
        interrupted = isinstance(exc, KeyboardInterrupt)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        try:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        except BaseException:
            traceback.print_exception(exc)
        code = 1
    finish(code, interrupted)


def system_exit_code(exc: SystemExit) -> int:
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
    """Py_FinalizeEx's part that the process's work can see, in its order, then ``os._exit``."""
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
