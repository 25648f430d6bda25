"""Gather facts once, each source bounded by a timeout; checks then read them without side effects.

A *gatherer* is a zero-argument callable (read NVML, read /dev/kmsg, run dcgmi...). All gatherers
run at the same time in daemon threads and the sweep waits at most ``timeout_s`` for them
together: a gatherer that hangs (nvidia-smi/NVML do hang after Xid 119) becomes a ``FactError``
naming it, and the process can still exit because the thread is a daemon.

A gatherer that cannot run on this node returns ``Unavailable(reason)``; checks reading it are
reported ``skipped`` with that reason. A gatherer that raises or times out yields ``FactError``;
checks reading it fail, naming the source.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Unavailable:
    """This source does not exist here (no NVML library, no dcgmi): checks on it are skipped."""

    reason: str


@dataclass(frozen=True)
class FactError:
    """Gathering this source failed or hung: checks on it fail with this message."""

    source: str
    message: str


class SkipCheck(Exception):
    """Raised by :meth:`Facts.need` when the source is Unavailable."""


class FactFailed(Exception):
    """Raised by :meth:`Facts.need` when the source could not be gathered."""


@dataclass(frozen=True)
class Facts:
    values: Mapping[str, Any]
    durations: Mapping[str, float]

    def raw(self, name: str) -> Any:
        """The gathered value as-is (possibly ``Unavailable`` or ``FactError``)."""
        return self.values[name]

    def need(self, name: str) -> Any:
        """The gathered value; raises SkipCheck / FactFailed for unavailable / failed sources."""
        value = self.values[name]
        if isinstance(value, Unavailable):
            raise SkipCheck(value.reason)
        if isinstance(value, FactError):
            raise FactFailed(f"{value.source}: {value.message}")
        return value


def gather(gatherers: Mapping[str, Callable[[], Any]], timeout_s: float) -> Facts:
    """Run every gatherer concurrently; give each what it returned, or a FactError."""
    results: dict[str, Any] = {}
    durations: dict[str, float] = {}
    lock = threading.Lock()

    def run(name: str, fn: Callable[[], Any]) -> None:
        start = time.monotonic()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - any failure of a source is a fact about it
            value = FactError(name, f"{type(exc).__name__}: {exc}")
        with lock:
            results[name] = value
            durations[name] = time.monotonic() - start

    threads = []
    for name, fn in gatherers.items():
        t = threading.Thread(target=run, args=(name, fn), name=f"gather-{name}", daemon=True)
        t.start()
        threads.append((name, t))
    deadline = time.monotonic() + timeout_s
    for _, t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        for name, t in threads:
            if name not in results:
                results[name] = FactError(name, f"timed out after {timeout_s:g} s")
                durations[name] = timeout_s
        return Facts(dict(results), dict(durations))
