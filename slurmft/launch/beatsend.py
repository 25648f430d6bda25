"""A node task's end of the TCP beat channel (``beatnet`` has the protocol and the launcher's end).

From its own thread (neither the file beat's, which a stalled filesystem blocks, nor torchrun's)
the task keeps one connection to the launcher and sends a BEAT every period; every connect and
send is bounded, and a failed one is retried at the next period on a new connection. The
launcher's OKs are the other direction's beat: ``acks`` counts them, and ``orphan`` reads it to
tell a live launcher on the batch host from a dead one (a refused or silent connection is
evidence; the batch host's alive file is the other channel).

The address, port and token come from the step's environment and are taken out of it
(``take_from``) before anything else starts: torchrun and the ranks never see the token.
"""

from __future__ import annotations

import os
import re
import select
import socket
import sys
import threading
from typing import MutableMapping

from slurmft.launch import beatnet

CONNECT_S = 2.0      # a connect or a send to a dead or partitioned batch host
END_ACK_S = 1.0      # the launcher's OK to the END line, so it has read it before we exit


class Sender:
    def __init__(self, host: str, port: int, token: str, node: str, step_id: str) -> None:
        self.host, self.port, self.token, self.node = host, port, token, node
        self.step_id = step_id if re.fullmatch(r"[0-9]{1,10}", step_id) else "-"
        self.acks = 0                      # OK lines read from the launcher
        self.status = "not connected yet"  # for the evidence of a batch host's death
        self._sock: socket.socket | None = None

    def run(self, stop: threading.Event, period_s: float) -> None:
        """Beat every ``period_s`` until ``stop``."""
        seq = 0
        while True:
            seq += 1
            self.beat(f"BEAT {seq}")
            if stop.wait(period_s):
                return

    def beat(self, line: str) -> None:
        """Send ``line`` (a HELLO first, on a new connection) and count the OKs that came."""
        try:
            if self._sock is None:
                self._connect()
            else:
                self._send(line)
            self._read(0.0)
        except OSError as exc:
            self._close(f"{'refused' if isinstance(exc, ConnectionRefusedError) else 'failed'}: "
                        f"{exc.strerror or exc}")

    def finish(self, status: int) -> None:
        """Say how the task ended and wait (bounded) for the launcher to have read it."""
        try:
            if self._sock is None:
                self._connect()
            self._send(f"END {status}")
            self._read(END_ACK_S, end=True)
        except OSError:
            pass
        self._close("ended")

    def acked(self) -> int:
        """How many OKs came from the launcher so far (``orphan`` watches it move)."""
        return self.acks

    def close(self) -> None:
        self._close("closed")

    def _connect(self) -> None:
        self._sock = socket.create_connection((self.host, self.port), timeout=CONNECT_S)
        self._send(f"HELLO {self.token} {self.node} {os.getpid()} {self.step_id}")
        self.status = "connected"

    def _send(self, line: str) -> None:
        if self._sock is None:
            raise OSError("not connected")
        self._sock.sendall(f"{line}\n".encode())

    def _read(self, wait_s: float, end: bool = False) -> None:
        """Count the OKs there now, or (``end``) wait up to ``wait_s`` for the END's OK."""
        got = b""
        while self._sock is not None:
            ready, _, _ = select.select([self._sock], [], [], wait_s)
            if not ready:
                return
            data = self._sock.recv(4096)
            if not data:
                self._close("closed by the launcher")
                return
            self.acks += data.count(b"\n")
            got = (got + data)[-64:]
            if not end:
                wait_s = 0.0
            elif beatnet.END_OK in got:
                return

    def _close(self, why: str) -> None:
        self.status = why
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def take_from(env: MutableMapping[str, str]) -> Sender | None:
    """The sender the launcher asked for in ``env``, its variables removed from ``env``; None
    when there is none (or it is not usable: said on stderr, the file channel goes on)."""
    values = {name: env.pop(name, None) for name in beatnet.ENV_NAMES}
    if not any(values.values()):
        return None
    host, port, token, node = (values[n] or "" for n in beatnet.ENV_NAMES)
    if not (host and port.isdigit() and 0 < int(port) < 65536 and len(token) == 32 and node):
        print("slurmft.launch.task: the TCP beat channel's settings are incomplete: beating "
              "through the alive file alone", file=sys.stderr, flush=True)
        return None
    return Sender(host, int(port), token, node, env.get("SLURM_STEP_ID", ""))
