"""The training step: one ``srun`` child of the launcher, waited for while forwarding signals to
it (see ``signals.py``). The pid is ours until we reap it, so a re-sent signal can never reach a
stranger's process."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Callable, Mapping, Sequence

from slurmft.launch import procs
from slurmft.launch.signals import SignalLog

POLL_S = 0.2


def run_step(argv: Sequence[str], env: Mapping[str, str], signals: SignalLog, resignal_s: float,
             on_signal: Callable[[str], None], pending: Sequence[str] = (),
             start: Callable[..., subprocess.Popen] = procs.start) -> int:
    """Run the step to its end; return srun's exit status (128+N when it died of signal N)."""
    proc = start(argv, env)
    next_send: float | None = None
    for name in pending:
        on_signal(name)
        next_send = time.monotonic()
    while True:
        try:
            rc = proc.wait(timeout=POLL_S)
            return rc if rc >= 0 else 128 - rc
        except subprocess.TimeoutExpired:
            pass
        for name in signals.take():
            on_signal(name)
            if next_send is None:
                next_send = time.monotonic()
        if next_send is not None and time.monotonic() >= next_send and proc.poll() is None:
            proc.send_signal(signal.SIGUSR2)  # Popen refuses once reaped: never a reused pid
            next_send = time.monotonic() + resignal_s
