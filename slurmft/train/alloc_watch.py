"""In-allocation mode, the ranks' side: leave a world the launcher re-forms, at once.

When a node of the allocation dies, the launcher on the batch host fences it and re-forms the
world (a spare takes its place, or the world shrinks, or the same nodes restart); it says so by
moving ``generation`` in ``<run_dir>/allocation.json`` (:mod:`slurmft.allocation`). The ranks that
survive may sit in a gloo collective with the dead peer, which cannot be aborted and would block
until the process-group timeout (600 s by default). So every rank runs :class:`AllocationWatch`:
a daemon thread that looks at the file every ``poll_s`` (0.5 s) and ends the process with
``os._exit(slurmft.exitcodes.REFORM)`` (88) when

* a node of this rank's world is fenced (whatever the generation: this also closes the window in
  which the generation moved between torchrun's rendezvous and this rank's first look), or
* the generation is newer than the first one this rank saw (its start generation) and the
  launcher decided a restart for this world: its ``active`` nodes are not this world's nodes
  (a spare took a place, or a node came in), or this rank does not know its world yet (before
  ``Run``'s all-gather: any new generation counts, as a dead peer may block that all-gather).

A newer generation that fences no node of this world and whose ``active`` nodes are this
world's is no reason: torchrun re-formed the world without the dead node before the launcher
fenced it (its agents drop a participant whose keep-alive expired, and the launcher's silence
bound is the same length), and the fence only confirms the world these ranks are. So torchrun's
keep-alive expiry needs no margin past the launcher's bound (``launch/nodesteps.py``).

Where the dead peer's sockets were closed (its processes killed, or every node on one host), gloo
raises at once instead of blocking, before the launcher has said anything: ``Run`` then calls
:meth:`AllocationWatch.await_verdict` with the exception, which waits up to a grace period
(``SLURMFT_NODE_SILENT_S`` + 5 s) for the new generation and ends the rank with 88 the same way;
without one the exception goes on (a failure of this rank's own). A signal meanwhile (torchrun's
agent stopping its workers after a peer crashed) ends the rank with 88 as well, journaling nothing:
not an exit 1, which its node's warm server would journal as this rank's crash.

A world that runs on fewer of the record's active nodes than it names (``missing``) was formed
by torchrun before every agent joined: with ``SLURMFT_MIN_NODES`` below the active nodes its
round closes ``last_call_timeout`` after the minimum joined, and a slow node's agent (or a
spare's, after a fence) joins the running world later, at which torchrun stops every worker with
SIGTERM to re-form it. Trained on, such a world would commit checkpoints of the wrong world size
and read that TERM as a preemption (an emergency save and exit 85: the job requeued). So ``Run``
calls :meth:`AllocationWatch.hold_while_partial` before its restore: the rank holds until the
world is the record's (the missing node fenced: the launcher's word), leaves with 88 on the
TERM (nothing trained, nothing journaled: the whole world's segment is the one that counts), or
trains on a partial world after ``PARTIAL_WAIT_S`` (said as a warning).

Before the exit, ``on_reform`` (``Run``'s: every rank says one line on stderr, and the lowest
rank on a node not fenced, rank 0 unless it died with its node, journals ``segment_end`` with
88) runs bounded by ``report_timeout_s``: the filesystem may be what hangs
(:mod:`slurmft.train.hard_exit`). torchrun's agent then sees its workers exit and restarts them
in the re-formed world, and they resume from the newest valid checkpoint.

A look costs one ``lstat``: the launcher replaces the file atomically (a new inode), so the file is
read and checked only when its inode, size or times changed, or every ``FULL_READ_S`` (5 s) at
least: NFS may answer ``lstat`` from its caches, an open revalidates. ``Run`` also calls :meth:`check` at
every step boundary. The file is untrusted input: one that cannot be read or checked is no reason
to end a healthy rank (said once on stderr; the watch goes on), nor is a record of another job, a
generation that went back, or a file that went away.

The watch is off, with no thread and no cost, unless ``allocation.json`` names this job when
:meth:`AllocationWatch.start_for` looks (the launcher writes it before starting any rank).
:func:`watch_allocation` is what ``Run`` calls (it adds the world's node names, gathered with one
``all_gather_object``); the module imports torch only there.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, TextIO

from slurmft import allocation, exitcodes
from slurmft.rundir import RunDir
from slurmft.train.hard_exit import exit_after_report

if TYPE_CHECKING:
    from slurmft.train.runtime import JobEnv

DEFAULT_POLL_S = 0.5
# A look reads the file at least this often even when its lstat did not change: NFS serves
# lstat from its attribute and name caches (seconds, up to a minute) while an open revalidates
# (close-to-open), so a rename over the file is seen within this on any filesystem.
FULL_READ_S = 5.0
# Longest a partial world holds its first step for the active nodes it lacks: the launcher's own
# start-up bound (``launch/inalloc.STARTUP_S``): a node whose task has not beaten by then is fenced.
PARTIAL_WAIT_S = 120.0
# What a collective with a dead peer raises: torch's DistError family, or a RuntimeError from the
# backend (gloo's "Connection closed by peer", "Connection reset by peer", NCCL's errors).
_WORLD_FAILURE = re.compile(r"gloo|nccl|connection (closed|reset|refused)|by peer|broken pipe", re.I)


def is_world_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because a peer is gone."""
    if not isinstance(exc, RuntimeError):
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"DistError", "DistBackendError", "DistNetworkError"}) or \
        bool(_WORLD_FAILURE.search(str(exc)[:2000]))


class AllocationWatch:
    """Ends this rank with exit 88 when the launcher re-forms its world (see the module docstring).

    run_dir: the run directory. job_ids: the ids this job goes by (the launcher's array-aware
    ``SLURMFT_JOB_ID`` and ``SLURM_JOB_ID``); a record naming none of them is not this job's.
    on_reform: called with the reason before the exit (bounded). poll_s: seconds between looks.
    report_timeout_s: longest the exit waits for ``on_reform``. stream: where a warning about an
    unusable file goes (stderr).
    """

    def __init__(self, run_dir: RunDir, job_ids: Iterable[str | None], *,
                 on_reform: Callable[[str], None] | None = None, poll_s: float = DEFAULT_POLL_S,
                 report_timeout_s: float = 5.0, stream: TextIO | None = None,
                 _exit: Callable[[int], None] = os._exit) -> None:
        if not poll_s > 0 or not report_timeout_s > 0:
            raise ValueError("allocation watch needs poll_s > 0 and report_timeout_s > 0")
        self.run_dir = run_dir
        self.job_ids = frozenset(j for j in job_ids if j)
        self.on_reform = on_reform
        self.poll_s = poll_s
        self.report_timeout_s = report_timeout_s
        self.stream = stream
        self._exit = _exit
        self.start_generation: int | None = None
        self.attempt: int | None = None  # the world's agreed attempt (watch_allocation)
        self.nodes_by_rank: list[str | None] = []  # rank r's node (watch_allocation)
        self._fenced_now: frozenset[str] = frozenset()  # fenced nodes in the record that fired
        self.world: frozenset[str] = frozenset()
        self.active: tuple[str, ...] | None = None  # the newest record's active nodes
        self.fired: str | None = None  # the reason, once fired
        self._seen: tuple[int, ...] | None = None
        self._read_at = float("-inf")  # monotonic time of the last read
        self._warned = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start_for(cls, run_dir: RunDir, job_ids: Iterable[str | None],
                  **kwargs) -> "AllocationWatch | None":
        """A started watch when ``allocation.json`` names this job now, else None (mode off)."""
        watch = cls(run_dir, job_ids, **kwargs)
        try:
            record = allocation.read(run_dir)
        except allocation.AllocationError as exc:
            # In-allocation mode (the file is there) but unusable: watch anyway; the first record
            # that checks gives the start generation. Ending a healthy rank would not fix it.
            watch._warn(exc)
            return watch.start()
        if record is None or record.job_id not in watch.job_ids:
            return None
        return watch.start()

    def set_world(self, nodes: Collection[str]) -> None:
        """The nodes this rank's world runs on (every rank's node, from ``Run``'s all-gather)."""
        with self._lock:
            self.world = frozenset(nodes)
            self._seen = None  # judge the record again against the world
        self.check()

    def start(self) -> "AllocationWatch":
        self.check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="slurmft-allocation-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def check(self) -> str | None:
        """Look at the file now (one ``stat`` when it did not change); end the process when the
        world is being re-formed. Returns the reason when ``_exit`` was replaced (tests)."""
        with self._lock:
            if self.fired is not None:
                return self.fired
            reason = self._look()
            if reason is None:
                return None
            self.fired = reason
        self._stop.set()
        exit_after_report(exitcodes.REFORM, lambda: self._report(reason),
                          report_timeout_s=self.report_timeout_s, who="slurmft allocation watch",
                          _exit=self._exit)
        return reason

    def reporter(self, rank: int) -> bool:
        """Whether this rank (``rank``) journals the re-form: the lowest rank on a node the record
        that fired did not fence (rank 0 when its node lives; another when rank 0 died with it)."""
        alive = [r for r, node in enumerate(self.nodes_by_rank) if node and node not in self._fenced_now]
        return rank == (min(alive) if alive else 0)

    def await_verdict(self, failure: BaseException, grace_s: float,
                      interrupted: Callable[[], bool] = lambda: False) -> str | None:
        """A collective failed in this rank (``failure``): on a one-host network, or when only a
        node's processes died, the peer's sockets are closed and gloo raises at once, before the
        launcher has fenced anything. Wait up to ``grace_s`` for its verdict: a new generation
        ends the rank with 88 here (the world is being re-formed: the failure was its symptom);
        None when none came (the caller re-raises: a failure of this rank's own). When
        ``interrupted()`` says a signal asked the rank to stop (torchrun's agent stopping its
        workers after a peer's crash: no verdict comes), the rank ends with 88 too, journaling
        nothing: its world is broken (nothing could be saved), and it did not crash (an exit 1
        would be journaled as a crash of this rank by its node's warm server, ``launch/rankexit``).
        Returns the reason only when ``_exit`` was replaced (tests)."""
        if not is_world_failure(failure):
            return None
        first = str(failure).strip().splitlines()[0][:300] if str(failure).strip() else ""
        self._say(f"slurmft allocation watch: a collective failed ({type(failure).__name__}: {first}); "
                  f"waiting up to {grace_s:g} s for the launcher to re-form the world")
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            reason = self.check()
            if reason is not None:
                return reason
            if interrupted():
                return self._leave("a signal asked this rank to stop its broken world: leaving")
            time.sleep(min(self.poll_s, 0.1))
        self._say(f"slurmft allocation watch: no new generation within {grace_s:g} s: "
                  "the failure is this rank's own")
        return None

    def missing(self) -> list[str]:
        """The record's active nodes this rank's world does not run on (none before the world
        is known or without a record)."""
        with self._lock:
            if not self.world or self.active is None:
                return []
            return sorted(set(self.active) - self.world)

    def hold_while_partial(self, bound_s: float = PARTIAL_WAIT_S) -> bool:
        """Hold a world that lacks active nodes (``missing``) before it trains, from the main
        thread: True once it is whole (the missing nodes fenced) or was, False after ``bound_s``
        (it then trains partial). A SIGTERM meanwhile is torchrun stopping this world to take
        the late agent in: the rank ends with 88 at once (returns False only when ``_exit`` was
        replaced, tests). Bounded; polls every 0.1 s at most."""
        missing = self.missing()
        if not missing:
            return True
        self._say(f"slurmft allocation watch: this world runs without active node(s) "
                  f"{', '.join(missing)} (torchrun closed its round before their agents joined): "
                  f"holding the first step until they join, are fenced, or {bound_s:g} s passed")
        termed = threading.Event()
        previous: object = None
        main = threading.current_thread() is threading.main_thread()
        if main:
            previous = signal.signal(signal.SIGTERM, lambda signum, frame: termed.set())
        try:
            deadline = time.monotonic() + bound_s
            while True:
                if termed.is_set():
                    self._leave(f"torchrun stopped this world (SIGTERM) to re-form it with "
                                f"{', '.join(missing)}: leaving before any step")
                    return False
                if self.check() is not None:  # a node of this world fenced: ended here (88)
                    return False
                missing = self.missing()
                if not missing:
                    self._say("slurmft allocation watch: the world is the allocation's active "
                              "nodes now: training")
                    return True
                if time.monotonic() >= deadline:
                    self._say(f"slurmft allocation watch: WARNING: still without {', '.join(missing)} "
                              f"after {bound_s:g} s: training on a partial world")
                    return False
                termed.wait(min(self.poll_s, 0.1))
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)  # type: ignore[arg-type]

    def _leave(self, why: str) -> str:
        """End the rank with 88 after one line, journaling nothing (torchrun stops this world)."""
        with self._lock:
            self.fired = why
        self._stop.set()
        exit_after_report(exitcodes.REFORM, lambda: self._say(f"slurmft allocation watch: {why}"),
                          report_timeout_s=self.report_timeout_s, who="slurmft allocation watch",
                          _exit=self._exit)
        return why

    def _look(self) -> str | None:
        path = self.run_dir.allocation
        try:
            st = os.lstat(path)
        except OSError:  # gone (or unreachable for now): no news is no reason to leave
            return None
        key = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        now = time.monotonic()
        if key == self._seen and now - self._read_at < FULL_READ_S:
            return None
        self._seen, self._read_at = key, now
        try:
            record = allocation.read(self.run_dir)
        except allocation.AllocationError as exc:
            self._warn(exc)
            return None
        if record is None or record.job_id not in self.job_ids:
            return None
        if self.start_generation is None:
            self.start_generation = record.generation
        self.active = record.active
        self._fenced_now = frozenset(record.fenced_nodes)
        fenced = sorted(self.world.intersection(record.fenced_nodes))
        moved = f"the allocation's generation moved from {self.start_generation} to {record.generation}"
        if fenced:
            return moved + f" (fenced: {', '.join(fenced)})" if record.generation > self.start_generation \
                else f"node(s) of this rank's world were fenced by the launcher: {', '.join(fenced)}"
        if record.generation <= self.start_generation:
            return None
        if not self.world:
            return moved
        if set(record.active) != self.world:
            return moved + f" (the world is re-formed on {', '.join(record.active)})"
        return None  # this world is the re-formed one already (torchrun re-formed it first)

    def _report(self, reason: str) -> None:
        if self.on_reform is not None:
            try:
                self.on_reform(reason)
            except Exception as exc:  # the exit must happen whatever the hook does
                self._say(f"slurmft allocation watch: on_reform hook failed: {exc}")

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            self._say(f"slurmft allocation watch: WARNING: {exc}; still watching")

    def _say(self, line: str) -> None:
        try:
            print(line, file=self.stream or sys.stderr, flush=True)
        except (OSError, ValueError):
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()


def watch_allocation(run_dir: RunDir, env: "JobEnv", process_group: Any, world_size: int, *,
                     on_reform: Callable[[str], None]) -> AllocationWatch | None:
    """``Run``'s watch: started when ``allocation.json`` names this job (None otherwise), then
    told every rank's node (one all-gather over ``process_group`` when ``world_size`` > 1), so a
    node fenced before this rank first looked at the file still ends it.

    The same all-gather agrees on the segment's ``attempt`` (the watch's ``attempt``): torchrun
    counts restarts per agent, and a spare's agent joins at 0 while the survivors' count on, so
    every rank takes the highest (the batch host's agent is in every world: it never goes back).
    A world without some of the record's active nodes is held here before it trains
    (:meth:`AllocationWatch.hold_while_partial`).
    """
    watch = AllocationWatch.start_for(run_dir, (env.slurm_id, env.job_id), on_reform=on_reform)
    if watch is None:
        return None
    mine = (env.node, env.attempt)
    gathered: list[Any] = [mine]
    if world_size > 1:
        import torch.distributed as dist

        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine, group=process_group)
    pairs = [g for g in gathered if isinstance(g, tuple) and len(g) == 2]
    watch.nodes_by_rank = [g[0] if isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], str) else None
                           for g in gathered]
    watch.attempt = max([env.attempt, *(a for _, a in pairs if isinstance(a, int))])
    watch.set_world([n for n, _ in pairs if isinstance(n, str)])
    watch.hold_while_partial()  # every rank of the world sees the same world and record
    return watch
