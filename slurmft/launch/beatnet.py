"""In-allocation mode's second liveness channel: the launcher's TCP listener for its nodes' beats.

The first channel, ``<run_dir>/alive/<node>.json``, is on the shared filesystem, which stalls
for seconds under load (Lustre/GPFS metadata, NFS attribute caches): on it alone a short silence
bound would fence healthy nodes. So each node's task also beats over TCP to the launcher on the
batch host (``beatsend``), and a node is silent only when neither channel beat within the bound
(``liveness``). The listener binds the batch host's own address on an ephemeral port; the
address, the port and a random per-run token reach the node tasks only through their step's
environment (``environ_for``), never through a file.

One ASCII line each way, at most ``MAX_LINE`` bytes:

  task -> launcher   HELLO <token> <node> <pid> <step id|->   first, within ``AUTH_S``
                     BEAT <seq>                               every second
                     END <exit status>                        as the task ends by itself
  launcher -> task   OK <n>                                   to every line it accepted
                     OK END                                   to the END line

A connection whose first line is not a HELLO with the token (compared in constant time) and a
node of the allocation, that says nothing within ``AUTH_S``, or that sends a malformed or
overlong line, is dropped; so are connections past ``max_conns``. One thread serves every
connection (``selectors``), so a node that stops reading never blocks the others.
"""

from __future__ import annotations

import hmac
import re
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Iterable

HOST_ENV = "SLURMFT_BEAT_HOST"     # set by the launcher on every node's step
PORT_ENV = "SLURMFT_BEAT_PORT"
TOKEN_ENV = "SLURMFT_BEAT_TOKEN"
NODE_ENV = "SLURMFT_BEAT_NODE"     # the node the launcher started this step for
ENV_NAMES = (HOST_ENV, PORT_ENV, TOKEN_ENV, NODE_ENV)

MAX_LINE = 256
AUTH_S = 5.0          # a new connection's HELLO, on a loaded node
SELECT_S = 0.5        # the serving loop's tick (expiry of unauthenticated connections)
TOKEN_BYTES = 16
END_OK = b"OK END\n"
_DIGITS = re.compile(r"^[0-9]{1,10}$")
_STATUS = re.compile(r"^-?[0-9]{1,4}$")
_NODE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_TOKEN = re.compile(r"^[0-9a-f]{32}$")


class BeatNetError(OSError):
    """The listener could not be opened (the caller goes on with the file channel alone)."""


@dataclass(frozen=True)
class NetBeat:
    """What the listener last heard from a node's task."""
    pid: int
    count: int               # lines accepted from it so far: each one is a beat
    step_id: str | None
    ended: int | None         # the exit status its END line gave
    connected: bool           # a connection from it is open now


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float | None    # monotonic: HELLO due by then (None once it came)
    buf: bytes = b""
    node: str | None = None


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def bind_address(host: str) -> tuple[int, tuple]:
    """(family, sockaddr with port 0) of ``host``'s first TCP address."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise BeatNetError(f"cannot resolve the batch host {host}: {exc}") from None
    if not infos:
        raise BeatNetError(f"the batch host {host} has no TCP address")
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


class Listener:
    """The launcher's end: accepts the nodes' beats on its own thread until ``close``."""

    def __init__(self, host: str, nodes: Iterable[str], token: str | None = None,
                 max_conns: int | None = None) -> None:
        family, sockaddr = bind_address(host)
        self.nodes = frozenset(nodes)
        self.token = token or new_token()
        self.max_conns = max_conns or 2 * len(self.nodes) + 8
        self._lock = threading.Lock()
        self._beats: dict[str, NetBeat] = {}
        self._open: dict[str, int] = {}      # node -> its authenticated connections open now
        self._conns: dict[int, _Conn] = {}
        self._stop = threading.Event()
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind(sockaddr)
            sock.listen(min(128, self.max_conns))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise BeatNetError(f"cannot listen on {sockaddr[0]}: {exc}") from None
        self._sock = sock
        self.address: str = sockaddr[0]
        self.port: int = sock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="slurmft-beatnet")
        self._thread.start()

    def environ_for(self, node: str) -> dict[str, str]:
        """What a node's step needs to beat here (its environment only: never a file)."""
        return {HOST_ENV: self.address, PORT_ENV: str(self.port), TOKEN_ENV: self.token,
                NODE_ENV: node}

    def admit(self, node: str) -> None:
        """Take beats from ``node`` too (a spare from outside the allocation: ``refill``)."""
        with self._lock:
            if node not in self.nodes:
                self.nodes = self.nodes | {node}
                self.max_conns += 2

    def beat(self, node: str) -> NetBeat | None:
        with self._lock:
            seen = self._beats.get(node)
            return None if seen is None else replace(seen, connected=self._open.get(node, 0) > 0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * SELECT_S)

    # -- the serving thread --------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(timeout=SELECT_S):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                self._expire()
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)
            self._sel.close()
            self._sock.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._sock.accept()
        except OSError:   # gone before we took it, or nothing there after all
            return
        if len(self._conns) >= self.max_conns:
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, time.monotonic() + AUTH_S)
        self._conns[id(conn)] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.buf += data
        while b"\n" in conn.buf:
            line, conn.buf = conn.buf.split(b"\n", 1)
            if len(line) > MAX_LINE or not self._line(conn, line):
                self._drop(conn)
                return
        if len(conn.buf) > MAX_LINE:
            self._drop(conn)

    def _line(self, conn: _Conn, raw: bytes) -> bool:
        """Take one line; False drops the connection."""
        try:
            words = raw.decode("ascii").split()
        except UnicodeDecodeError:
            return False
        if conn.node is None:
            if len(words) != 5 or words[0] != "HELLO" or not _TOKEN.fullmatch(words[1]) \
                    or not hmac.compare_digest(words[1], self.token) or words[2] not in self.nodes \
                    or not _DIGITS.fullmatch(words[3]) \
                    or not (words[4] == "-" or _DIGITS.fullmatch(words[4])):
                return False
            conn.node, conn.deadline = words[2], None
            with self._lock:
                old = self._beats.get(conn.node)
                self._beats[conn.node] = NetBeat(int(words[3]), (old.count if old else 0) + 1,
                                                 None if words[4] == "-" else words[4], None, True)
                self._open[conn.node] = self._open.get(conn.node, 0) + 1
        elif len(words) == 2 and words[0] == "BEAT" and _DIGITS.fullmatch(words[1]):
            self._count(conn.node)
        elif len(words) == 2 and words[0] == "END" and _STATUS.fullmatch(words[1]):
            self._count(conn.node, ended=int(words[1]))
        else:
            return False
        try:
            conn.sock.send(END_OK if words[0] == "END" else
                           f"OK {self._beats[conn.node].count}\n".encode())
        except OSError:   # its buffer is full (it does not read) or it is gone: no ack then
            pass
        return True

    def _count(self, node: str, ended: int | None = None) -> None:
        with self._lock:
            seen = self._beats[node]
            self._beats[node] = replace(seen, count=seen.count + 1,
                                        ended=seen.ended if ended is None else ended)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.deadline is not None and now > c.deadline]:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(id(conn), None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.node is not None:
            with self._lock:
                self._open[conn.node] = max(0, self._open.get(conn.node, 1) - 1)

