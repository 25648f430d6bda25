"""The warm-worker client: what torchrun starts as a rank with warm workers (``SLURMFT_WARM_WORKERS``).

``python -I -S .../warmclient.py [-m MODULE | SCRIPT] ARGS...`` (standard library only, run by
path so it imports nothing of slurmft nor site-packages: it starts in tens of milliseconds).
It hands its node's warm server (``slurmft.launch.warm``, socket ``$SLURMFT_WARM_SOCKET``) the
rank's argv, environment, cwd, ignored signals and stdio (fds 0-2 over the Unix socket,
SCM_RIGHTS); the server forks a worker that already has torch imported. Then the client stands
where the rank would: every signal torchrun sends it (TERM, INT, HUP, QUIT, USR1, USR2) goes to
the worker's process group, the client exits with the worker's status (killed by signal N: the
client kills itself with N, so torchrun sees the same -N), and the client's own death (even
SIGKILL: the socket closes) takes the worker with it. When torchrun is gone (the client is
reparented), the worker gets SIGUSR2, as a rank's own orphan watch would have it (save, 85).

torchrun's stop of its workers for a restart (``LocalElasticAgent._stop_workers``) is a TERM with a
fixed 30 s before its KILL (``--shutdown-timeout`` is not passed there, pytorch/pytorch#119856): a
frozen rank (SIGSTOPped, or a hang holding the GIL) cost every restart in place those 30 s. So
after a TERM the client asks the server to KILL its worker when the worker is stopped (state T
for ``STOPPED_CONFIRM_S``) or has not ended ``$SLURMFT_WARM_STOP_GRACE_S`` (15 s) after it;
the server journals no crash for it. Never when the TERM may be a real stop whose ranks save:
the client relayed a USR1 or USR2 (in-allocation mode's preemption, the time limit, its own
orphan rule), any INT, HUP or QUIT, or the node's task marked its node stopping
(``stopping_marker``: Slurm's TERM, the launcher's stop, the batch host's death); those keep
torchrun's own bound.

No server, a refused connection, or a server that dies or refuses before the worker started:
nothing ran, so the client runs the rank cold (``exec python -u ...``) with one line on stderr.
It waits ``CONNECT_S`` for the socket to appear and ``$SLURMFT_WARM_WAIT_S`` (300 s) for the
worker's start (the server may still be importing). The server dying under a running worker:
the client kills the worker (nobody can reap it and pass its status on) and exits 1.

Wire format (this module owns it; the server imports it): the request is a 4-byte big-endian
length and a JSON object, fds 0, 1, 2 attached to its first byte; the server answers
``P`` + pid (the worker started, its pid is its process group), ``X`` + status (the worker
ended: an exit code, or minus the signal that killed it), or ``E`` + a message (refused).
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Mapping, NoReturn

SOCKET_ENV = "SLURMFT_WARM_SOCKET"
WAIT_ENV = "SLURMFT_WARM_WAIT_S"
STOP_GRACE_ENV = "SLURMFT_WARM_STOP_GRACE_S"
VERSION = 1
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)
WAIT_S = 300.0          # for the worker's pid: the server may still be importing torch
PARENT_POLL_S = 0.5
CONNECT_S = 10.0        # for the socket to appear
MAX_REQUEST = 16 << 20
# After torchrun's TERM: a worker stopped this long is killed; one still there after the grace too.
# The grace outlasts a rank's own bounded exits after a TERM (train/hard_exit.py: 5 s; the
# watchdog's report: 10 s), so what a healthy rank journals on its way out is not cut.
# Stopped at two polls in a row (STOP_POLL_S apart): a ptrace stop (py-spy, a debugger) is
# milliseconds; each 0.75 s more was paid by every restart after a hang (the soak of 2026-11-28).
STOPPED_CONFIRM_S = 0.25
STOP_GRACE_S = 15.0
STOP_POLL_S = 0.25
STOPPING_NAME = "stopping"   # beside the socket: the node's task is stopping torchrun for real
KILL_REQUEST = b"S"          # client -> server: kill my worker (torchrun stopped it), no crash
_INT = struct.Struct(">i")


class ProtocolError(Exception):
    pass


def encode_request(payload: dict) -> bytes:
    data = json.dumps(payload).encode()
    return _INT.pack(len(data)) + data


def send_request(sock: socket.socket, payload: dict, fds: tuple[int, ...] = (0, 1, 2)) -> None:
    data = encode_request(payload)
    sent = sock.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    if sent != 1:
        raise ProtocolError("the request's first byte was not sent")
    sock.sendall(data[1:])


def recv_request(sock: socket.socket) -> tuple[dict, list[int]]:
    """Read one request; returns it and the fds it carried (the caller owns and closes them)."""
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(1, socket.CMSG_SPACE(8 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - (len(data) % fds.itemsize)])
    try:
        if len(msg) != 1:
            raise ProtocolError("the client closed before its request")
        head = msg + _recv_exact(sock, _INT.size - 1)
        (size,) = _INT.unpack(head)
        if not 0 < size <= MAX_REQUEST:
            raise ProtocolError(f"a request of {size} bytes")
        payload = json.loads(_recv_exact(sock, size))
        if not isinstance(payload, dict):
            raise ProtocolError("the request is not a JSON object")
        return payload, list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ProtocolError("the peer closed mid-message")
        out += chunk
    return out


def stopping_marker(socket_path: str) -> str:
    """The file the node's task creates before it passes a TERM or INT on to torchrun."""
    return os.path.join(os.path.dirname(socket_path), STOPPING_NAME)


def stop_grace_s(environ: Mapping[str, str]) -> float:
    """``$SLURMFT_WARM_STOP_GRACE_S`` (seconds > 0), else ``STOP_GRACE_S``; a bad value raises
    ValueError naming the variable (the launcher refuses it at the start: ``warm.settings``)."""
    raw = (environ.get(STOP_GRACE_ENV) or "").strip()
    if not raw:
        return STOP_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{STOP_GRACE_ENV}={raw!r} must be a number of seconds > 0")
    return value


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/PID/stat`` (R, S, D, T, t, Z...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


class StopWatch:
    """Whether torchrun's TERM to this rank should become a KILL before torchrun's own 30 s.

    ``signalled`` records each relayed signal; ``due(now, state)`` is the reason to kill once
    it is due (a TERM relayed, none of the signals that mean a real stop, the node not marked
    stopping, and the worker stopped ``STOPPED_CONFIRM_S`` or still there ``grace_s`` after the
    TERM), else None. Pure but for the marker's ``exists``; the caller reads the state."""

    def __init__(self, marker: str | None, grace_s: float) -> None:
        self.marker, self.grace_s = marker, grace_s
        self.term_at: float | None = None
        self.held: str | None = None        # why this stop is left to torchrun
        self.stopped_since: float | None = None

    def signalled(self, signum: int, now: float) -> None:
        if signum == signal.SIGTERM:
            if self.term_at is None:
                self.term_at = now
        elif self.held is None:
            self.held = f"{signal.Signals(signum).name} relayed"

    def due(self, now: float, state: str | None) -> str | None:
        if self.term_at is None or self.held is not None or state in (None, "Z"):
            return None   # no TERM, a real stop, or the worker ended (the server reaps it)
        if self.marker is not None and os.path.exists(self.marker):
            self.held = "the node is stopping"
            return None
        if state in ("T", "t"):
            self.stopped_since = self.stopped_since if self.stopped_since is not None else now
            if now - self.stopped_since >= STOPPED_CONFIRM_S:
                return f"stopped (state {state}) {now - self.term_at:.1f} s after torchrun's TERM"
        else:
            self.stopped_since = None
        if now - self.term_at >= self.grace_s:
            return f"still running (state {state}) {now - self.term_at:.1f} s after torchrun's TERM"
        return None


def reply(kind: bytes, value: int | str) -> bytes:
    if isinstance(value, int):
        return kind + _INT.pack(value)
    body = value.encode()[:4096]
    return kind + _INT.pack(len(body)) + body


def read_reply(sock: socket.socket) -> tuple[str, int | str] | None:
    """One answer of the server, or None when it closed first."""
    kind = sock.recv(1)
    if not kind:
        return None
    (value,) = _INT.unpack(_recv_exact(sock, _INT.size))
    if kind == b"E":
        return "E", _recv_exact(sock, value).decode(errors="replace")
    if kind not in (b"P", b"X"):
        raise ProtocolError(f"unknown answer {kind!r}")
    return kind.decode(), value


# -- the client ----------------------------------------------------------------------------------

def run_cold(command: list[str], why: str) -> NoReturn:
    print(f"slurmft warm client: {why}; starting this rank cold", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-u", *command])


def _ignored() -> list[int]:
    return [int(s) for s in RELAYED if signal.getsignal(s) == signal.SIG_IGN]


def _die_like(status: int) -> None:
    """Exit as the worker did: its code, or killed by its signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status < 0:
        sig = -status
        try:
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
        time.sleep(1.0)
        os._exit(128 + sig)
    os._exit(status)


def signal_worker(pid: int, signum: int) -> None:
    """The worker's process group; the worker itself while it is not yet in its own session
    (just forked: the server forks it with the relayed signals blocked until it is the rank)."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _connect(sock: socket.socket, path: str) -> None:
    """torchrun's agent binds the server's socket before it forks the server and starts its
    workers; give a server started as a process of its own CONNECT_S to bind. A socket that
    refuses is a dead server's (nobody listens): no wait."""
    sock.settimeout(5.0)
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            sock.connect(path)
            return
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def client(command: list[str], environ: dict[str, str]) -> None:
    path = environ.get(SOCKET_ENV)
    if not path:
        run_cold(command, f"{SOCKET_ENV} is not set")
    try:
        wait_s = float(environ.get(WAIT_ENV) or WAIT_S)
    except ValueError:
        wait_s = WAIT_S
    try:
        grace_s = stop_grace_s(environ)
    except ValueError:   # refused by the launcher at the start: only a hand-made environment
        grace_s = STOP_GRACE_S
    watch = StopWatch(stopping_marker(path), grace_s)
    pending: list[int] = []
    worker: list[int] = []   # its pid once started

    def relay(signum: int, frame: object) -> None:
        if worker:
            watch.signalled(signum, time.monotonic())
            signal_worker(worker[0], signum)
        else:
            pending.append(signum)

    ignored = _ignored()
    for sig in RELAYED:
        signal.signal(sig, relay)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _connect(sock, path)
        send_request(sock, {"version": VERSION, "argv": command, "env": dict(environ),
                            "cwd": os.getcwd(), "client_pid": os.getpid(), "ignored": ignored})
        sock.settimeout(wait_s)
        answer = read_reply(sock)
    except (OSError, ProtocolError) as exc:
        sock.close()
        if pending:
            _die_like(-pending[0])
        run_cold(command, f"no warm worker from {path} ({exc})")
    if answer is None or answer[0] != "P":
        sock.close()
        if pending:
            _die_like(-pending[0])
        why = "the warm server closed before starting the worker" if answer is None else \
            f"the warm server refused: {answer[1]}"
        run_cold(command, why)
    worker.append(int(answer[1]))
    for signum in pending:
        relay(signum, None)
    _supervise(sock, worker[0], watch)


def _supervise(sock: socket.socket, pgid: int, watch: StopWatch) -> None:
    parent = os.getppid()
    orphan_told = False
    kill_asked = False
    sock.setblocking(True)
    sock.settimeout(None)
    while True:
        poll_s = STOP_POLL_S if watch.term_at is not None and not kill_asked else PARENT_POLL_S
        try:
            ready, _, _ = select.select([sock], [], [], poll_s)
        except InterruptedError:
            continue
        if ready:
            try:
                answer = read_reply(sock)
            except (OSError, ProtocolError) as exc:
                answer, lost = None, str(exc)
            else:
                lost = "it closed the connection"
            if answer is not None and answer[0] == "X":
                _die_like(int(answer[1]))
            # The server is gone with the worker running: end it (nobody else reaps its status).
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            print(f"slurmft warm client: lost the warm server ({lost}); worker {pgid} killed",
                  file=sys.stderr, flush=True)
            os._exit(1)
        if not orphan_told and os.getppid() != parent:
            orphan_told = True   # torchrun is gone: the rank's orphan rule (save, requeue)
            watch.signalled(signal.SIGUSR2, time.monotonic())
            try:
                os.killpg(pgid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        why = None if kill_asked else watch.due(time.monotonic(), process_state(pgid))
        if why is not None:
            # The server kills it (its parent: it then journals no crash) and sends its status.
            kill_asked = True
            print(f"slurmft warm client: worker {pgid} {why}: killed, not waiting for torchrun's "
                  "30 s", file=sys.stderr, flush=True)
            try:
                sock.sendall(KILL_REQUEST)
            except OSError:
                pass   # the server is gone: the next select sees it and kills the worker


def main() -> None:
    command = sys.argv[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or (command[0] == "-m" and len(command) < 2):
        sys.exit("slurmft warm client: expected [-m MODULE | SCRIPT] ARGS...")
    client(command, dict(os.environ))


if __name__ == "__main__":
    main()
