"""Ending a rank that may be stuck: report first, bounded, then ``os._exit`` whatever happened.

Both the step watchdog (a hung step, exit 87) and the allocation watch (a world the launcher
re-forms, exit 88) end the process from a daemon thread while the training thread may sit in a
collective that cannot be unwound, so ``sys.exit`` is useless and ``os._exit`` is the only way.
What they say first (a line, stacks, a journal event) may sit on the shared filesystem, which
may be what hangs, so the exit never waits for it longer than ``report_timeout_s``: the report
runs on its own thread. A report blocked while holding the GIL (``faulthandler`` writes to a
hung file that way) would stop that Python-level wait too, so ``faulthandler``'s own C thread,
which needs no GIL, is armed first to end the process a moment later with exit code 1 as a last
resort.
"""

from __future__ import annotations

import faulthandler
import os
import threading
from typing import Callable

# Seconds the C-level backstop waits beyond report_timeout_s (the Python path normally exits first).
BACKSTOP_MARGIN_S = 2.0


def exit_after_report(code: int, report: Callable[[], None], *, report_timeout_s: float, who: str,
                      _exit: Callable[[int], None] = os._exit) -> None:
    """Run ``report`` on a thread, wait at most ``report_timeout_s`` for it, then ``_exit(code)``.

    ``who`` prefixes the note written when the report did not finish in time ("slurmft watchdog").
    Returns only when ``_exit`` was replaced (tests).
    """
    _arm_backstop(report_timeout_s + BACKSTOP_MARGIN_S)
    reported = threading.Event()

    def run_report() -> None:
        try:
            report()
        finally:
            reported.set()

    threading.Thread(target=run_report, name=f"{who}-report", daemon=True).start()
    if not reported.wait(report_timeout_s):
        # Said from yet another thread: stderr itself may be what hangs.
        note = (f"{who}: reporting did not finish within {report_timeout_s:g} s "
                f"(stderr or the journal's filesystem hangs); exiting without it\n")
        threading.Thread(target=_write_fd, args=(2, note), daemon=True).start()
    _exit(code)
    faulthandler.cancel_dump_traceback_later()  # reached only when _exit was replaced (tests)


def _arm_backstop(after_s: float) -> None:
    """End the process with exit code 1 after ``after_s`` seconds from a C thread (needs no GIL).

    Its stack dump goes to /dev/null: the report is the caller's job, and writing it here could
    block on the very file that hangs.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        faulthandler.dump_traceback_later(after_s, exit=True, file=devnull)
    except (OSError, RuntimeError, ValueError):
        pass


def _write_fd(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode())
    except OSError:
        pass
