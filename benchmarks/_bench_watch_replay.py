"""The long replay of watch_scale_bench.py: the watcher's decision code against healthy runs.

Each simulated run trains for ``days`` of simulated time in a real run dir: a node's clock drives
the real heartbeat writer (``slurmft.train.heartbeat.Heartbeat``) on every step, rank 0 journals
what ``slurmft.train.Run`` and the launcher journal (segment start with the load, losses every
``log_every`` steps, committed checkpoints after blocking saves, the time limit's signal, the
emergency save, exit 85 and the template's requeue), and a simulated controller shows the job as
``squeue`` would (RUNNING, COMPLETING, PENDING on its BeginTime after the requeue, RUNNING again
with the next restart count). Every ``poll_s`` of simulated time the real ``RunWatch`` (detect +
the run's state machine, with its caches) is stepped with that job and a healthy node table; its
Slurm client is a stand-in that records every call (and starts a pending job sooner on
``StartTime=now``, as Slurm does).

The runs are healthy by construction: steps of 0.1 s to 60 s, blocking saves of up to 10
minutes, loads at every start, evaluations of up to 20 minutes, one node clock stepped back 30 s
and another forward 30 s, and a time limit that ends every run 100 times. Any fault_detected,
recovery_action, gave_up or job_resubmitted the watcher journals (or any call it makes other than
the StartTime=now of a planned restart) is an action on a healthy run: the result lists each.
Simulated time runs from ``days`` + 1 days ago, and every file the runs write gets the mtime of
the simulated moment it was written: the watcher's stat-first caches then see the same
signatures, at the same simulated moments, as they would in real time. What the replay leaves
out to finish in minutes: fsync (the run dirs are on a tmpfs), and the heartbeat writes the
watcher could never see: the writer's beats between two polls are kept in memory and only the
newest is written (the file the watcher reads at each poll is exactly the one the real writer
would have left).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from slurmft import exitcodes, journal
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobState, Node, NodeState
from slurmft.train import heartbeat as heartbeat_module
from slurmft.train.heartbeat import Heartbeat
from slurmft.watch.config import WatchConfig
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import RunState

MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
ACTIONS = (journal.FAULT_DETECTED, journal.RECOVERY_ACTION, journal.GAVE_UP, journal.JOB_RESUBMITTED)
PLANNED = (journal.PLANNED_END, journal.RESTART_ACTION)
SIGNAL_BEFORE_S = 180.0  # --signal=USR1@180: the time limit's warning
REQUEUE_DELAY_S = 120.0  # Slurm's BeginTime after a requeue
SCRIPT = "#!/bin/bash\n#SBATCH --requeue\nexec slurmft-launch\n"


@dataclass(frozen=True)
class Profile:
    name: str
    step_s: float
    log_every: int       # steps between loss lines (about one every 10 s or more)
    save_every_s: float  # training time between periodic saves
    save_s: float        # a save's blocking time
    eval_every_s: float
    eval_s: float
    load_s: float        # the checkpoint load at every segment start
    skew_at_s: float | None = None  # when the node clock steps (simulated seconds into the run)
    skew_s: float = 0.0


PROFILES = (
    Profile("0.1 s steps", 0.1, 100, 30 * MINUTE, 2 * MINUTE, 4 * HOUR, 5 * MINUTE, 3 * MINUTE),
    Profile("2 s steps, clock -30 s", 2.0, 5, HOUR, 5 * MINUTE, 6 * HOUR, 10 * MINUTE, 5 * MINUTE,
            skew_at_s=0.33, skew_s=-30.0),
    Profile("20 s steps, clock +30 s", 20.0, 1, HOUR, 10 * MINUTE, 8 * HOUR, 15 * MINUTE, 10 * MINUTE,
            skew_at_s=0.66, skew_s=30.0),
    Profile("60 s steps", 60.0, 1, 2 * HOUR, 10 * MINUTE, 12 * HOUR, 20 * MINUTE, 10 * MINUTE),
)


@contextlib.contextmanager
def _phase(beats: list[Heartbeat], name: str, bound_s: float) -> Iterator[None]:
    """A long phase on every node, announced with its bound (``Heartbeat.phase``: a beat as it
    starts, one as it ends), as ``Run`` and ``CheckpointManager`` announce theirs."""
    with contextlib.ExitStack() as stack:
        for hb in beats:
            stack.enter_context(hb.phase(name, bound_s))
        yield


class Recorder:
    """The watcher's Slurm client: records every call; answers the capture of the submission."""

    def __init__(self, work_dir: Path, on_start_now: Callable[[str], None]) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.work_dir, self.on_start_now = work_dir, on_start_now

    def submit_line(self, job_id: str) -> str:
        return "sbatch train.sbatch"

    def batch_script(self, job_id: str) -> str:
        return SCRIPT

    def update_pending(self, job_id: str, **kwargs: Any) -> None:
        self.calls.append(("update_pending", (job_id, tuple(sorted(kwargs.items())))))
        if kwargs.get("start_now"):
            self.on_start_now(job_id)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            return True
        return call


class DeferredBeats:
    """Stands in for ``atomic_write_json`` inside the heartbeat module: the newest beat per file,
    written (atomically, mtime set to the simulated time) by ``flush``."""

    def __init__(self) -> None:
        self.pending: dict[Path, tuple[Any, float]] = {}
        self.clock: Callable[[], float] = time.time

    def __call__(self, path: Path, obj: Any) -> None:
        self.pending[path] = (obj, self.clock())

    def flush(self) -> None:
        dirs: dict[Path, float] = {}
        for path, (obj, when) in self.pending.items():
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.parent.mkdir(exist_ok=True)
            tmp.write_text(json.dumps(obj))
            os.utime(tmp, (when, when))
            os.replace(tmp, path)  # atomic, as the writer's own (whose fsync is moot on a tmpfs)
            dirs[path.parent] = max(dirs.get(path.parent, 0.0), when)
        for folder, when in dirs.items():
            os.utime(folder, (when, when))
        self.pending.clear()


class SimRun:
    """One healthy run: its trainer (a generator over simulated time) and its job as squeue shows it."""

    def __init__(self, root: Path, index: int, profile: Profile, days: float, ends: int,
                 t0: float, beats: DeferredBeats) -> None:
        self.p, self.days = profile, days
        self.rd = RunDir(root / f"run{index}")
        self.rd.root.mkdir(parents=True)
        (self.rd.root / "train.sbatch").write_text(SCRIPT)
        self.job_id = str(5000 + index)
        self.nodes = (f"sim{index}a", f"sim{index}b")
        self.limit_s = days * DAY / (ends + 1)
        self.t0 = self.now = self.horizon = t0
        self.deferred = beats
        self.restart = 0
        self.step = 0
        self.state, self.reason, self.completing = JobState.PENDING, "Priority", False
        self.start_time: float | None = None
        self.pending_until = t0 + 30.0
        self.planned_ends = 0
        self._gen = self._life()
        self._next = next(self._gen)

    # -- the node's clock and rank 0's journal ---------------------------------------------------

    def node_time(self) -> float:
        skew_at = self.p.skew_at_s
        stepped = skew_at is not None and self.now >= self.t0 + skew_at * self.days * DAY
        return self.now + (self.p.skew_s if stepped else 0.0)

    def record(self, kind: str, **fields: Any) -> None:
        line = journal.encode_event(kind, {"job_id": self.job_id, "restart_count": self.restart, **fields},
                                    now=self.node_time())
        with open(self.rd.events, "ab") as fh:
            fh.write(line)
        os.utime(self.rd.events, (self.now, self.now))

    # -- the controller's view --------------------------------------------------------------------

    def job(self) -> Job:
        start = datetime.fromtimestamp(self.start_time, tz=timezone.utc) if self.start_time else None
        limit_end = (datetime.fromtimestamp(self.start_time + self.limit_s, tz=timezone.utc)
                     if self.start_time and self.state is JobState.RUNNING else None)
        return Job(job_id=self.job_id, name="train", state=self.state, reason=self.reason,
                   flags=frozenset({"COMPLETING"}) if self.completing else frozenset(),
                   nodes=self.nodes if self.state is JobState.RUNNING else (), node_count=2,
                   restart_count=self.restart, submit_time=datetime.fromtimestamp(self.t0, tz=timezone.utc),
                   start_time=start, time_limit_end=limit_end, user="sim", work_dir=self.rd.root,
                   run_dir=self.rd.root)

    def start_now(self) -> None:
        if self.state is JobState.PENDING:
            self.pending_until = min(self.pending_until, self.now + 2.0)
            self._next = min(self._next, self.pending_until)  # the queue loop looks again then

    def advance(self, until: float) -> None:
        """Everything the run and Slurm do up to ``until``."""
        self.deferred.clock = self.node_time
        self.horizon = until
        while self._next <= until:
            self.now = self._next
            self._next = next(self._gen)
        self.now = until
        self.deferred.flush()

    def _wait(self, seconds: float) -> Iterator[float]:
        yield self.now + seconds

    # -- the run's life ---------------------------------------------------------------------------

    def _life(self) -> Iterator[float]:
        end = self.t0 + self.days * DAY
        while self.now < end:
            while self.now < self.pending_until:  # queued (BeginTime after a requeue)
                yield min(self.pending_until, self.now + 60.0)
            self.state, self.reason, self.start_time = JobState.RUNNING, "None", self.now
            yield from self._segment(min(self.now + self.limit_s, end))
        while True:
            yield float("inf")

    def _segment(self, limit_at: float) -> Iterator[float]:
        p = self.p
        beats = [Heartbeat(self.rd, node, job_id=self.job_id, restart_count=self.restart,
                           clock=self.node_time, monotonic=lambda: self.now) for node in self.nodes]
        yield from self._wait(8.0)  # srun, torch import, rendezvous
        restored = self.step
        with _phase(beats, "load", p.load_s * 2):
            yield from self._wait(p.load_s)
        self.record(journal.SEGMENT_START, world_size=16, num_nodes=2, nodelist=",".join(self.nodes),
                    node=self.nodes[0], restored_step=restored or None, load_s=p.load_s)
        signal_at = limit_at - SIGNAL_BEFORE_S
        next_save = self.now + p.save_every_s
        next_eval = self.now + p.eval_every_s
        while True:
            step_end = self.now + p.step_s
            if step_end >= signal_at:
                break
            if step_end > self.horizon:
                yield step_end
            else:  # within this advance: no need to hand control back (fast steps)
                self.now = step_end
            self.step += 1
            if self.step % p.log_every == 0:
                self.record(journal.LOSS, step=self.step, loss=2.0, grad_norm=1.0, world_size=16)
            for hb in beats:
                hb.beat(self.step)
            if self.now >= next_save:
                yield from self._save(beats, p.save_s)
                next_save = self.now + p.save_every_s
            elif self.now >= next_eval:
                with _phase(beats, "eval", p.eval_s * 2):
                    yield from self._wait(p.eval_s)
                next_eval = self.now + p.eval_every_s
        if self.now >= self.days * DAY + self.t0:
            return
        # The time limit's signal: one emergency save, exit 85, the template requeues the job.
        yield signal_at
        self.record(journal.PREEMPTION, step=self.step, signal="USR1")
        yield from self._save(beats, min(p.save_s, SIGNAL_BEFORE_S - 30.0))
        self.record(journal.SEGMENT_END, exit_code=exitcodes.REQUEUE,
                    outcome=exitcodes.describe(exitcodes.REQUEUE), reason="preempted", step=self.step)
        self.record(journal.TEMPLATE, action="requeue", reason="training saved and asked to be requeued",
                    exclude="")
        self.completing = True
        yield from self._wait(5.0)
        self.state, self.reason, self.completing = JobState.PENDING, "BeginTime", False
        self.restart += 1
        self.start_time = None
        self.planned_ends += 1
        self.pending_until = self.now + REQUEUE_DELAY_S + 30.0 * (self.restart % 7)

    def _save(self, beats: list[Heartbeat], seconds: float) -> Iterator[float]:
        with _phase(beats, "save", seconds * 2):
            yield from self._wait(seconds)
        self.record(journal.CHECKPOINT_COMMITTED, step=self.step, path=f"step_{self.step:09d}",
                    tier="shared", blocking_s=seconds, total_s=seconds)


@dataclass
class ReplayResult:
    days: float
    runs: int
    cycles: int
    planned_ends: int
    actions: list[dict]
    planned: Counter
    warnings: Counter
    calls: Counter
    wall_s: float

    def as_json(self) -> dict:
        return {"replay_days": self.days, "replay_runs": self.runs, "replay_cycles": self.cycles,
                "replay_planned_ends": self.planned_ends,
                "replay_actions_healthy": len(self.actions), "replay_action_details": self.actions[:20],
                "replay_planned_events": dict(self.planned), "replay_warnings": dict(self.warnings),
                "replay_client_calls": dict(self.calls), "replay_wall_s": round(self.wall_s, 1)}


def replay(days: float = 30.0, ends: int = 100, poll_s: float | None = None,
           profiles: tuple[Profile, ...] = PROFILES, work: Path | None = None,
           processes: int = 1) -> ReplayResult:
    """Every profile's run for ``days`` with ``ends`` planned time-limit ends each; with
    ``processes`` > 1 the runs are replayed side by side (each run's replay is independent)."""
    if processes > 1 and len(profiles) > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(min(processes, len(profiles))) as pool:
            parts = pool.starmap(replay, [(days, ends, poll_s, (p,), work, 1) for p in profiles])
        merged = ReplayResult(days, 0, 0, 0, [], Counter(), Counter(), Counter(), 0.0)
        for part in parts:
            merged.runs += part.runs
            merged.cycles = max(merged.cycles, part.cycles)
            merged.planned_ends += part.planned_ends
            merged.actions += part.actions
            merged.planned.update(part.planned)
            merged.warnings.update(part.warnings)
            merged.calls.update(part.calls)
            merged.wall_s = max(merged.wall_s, part.wall_s)
        return merged
    return _replay(days, ends, poll_s, profiles, work)


def _replay(days: float, ends: int, poll_s: float | None, profiles: tuple[Profile, ...],
            work: Path | None) -> ReplayResult:
    cfg = WatchConfig() if poll_s is None else WatchConfig(poll_s=poll_s)
    if work is None and os.path.isdir("/dev/shm"):
        work = Path("/dev/shm")  # millions of small renames: a tmpfs keeps the replay in minutes
    root = Path(tempfile.mkdtemp(prefix="slurmft-replay-", dir=work))
    real_fsync = os.fsync
    os.fsync = lambda fd: None  # type: ignore[assignment]
    deferred = DeferredBeats()
    real_write = heartbeat_module.atomic_write_json
    heartbeat_module.atomic_write_json = deferred  # type: ignore[assignment]
    t0 = float(int(time.time() - (days + 1) * DAY))
    started = time.monotonic()
    try:
        sims, watchers, clients = [], [], []
        actions: list[dict] = []
        planned: Counter = Counter()
        warnings: Counter = Counter()
        clock = [t0]

        def listener(sim: SimRun) -> Callable[[str, Any], None]:
            def heard(kind: str, event: Any) -> None:
                if kind in ACTIONS:
                    actions.append({"run": sim.p.name, "t_days": round((clock[0] - t0) / DAY, 3),
                                    "kind": kind, **{k: event.get(k) for k in
                                                     ("cause", "evidence", "action", "reason")
                                                     if event.get(k) is not None}})
                elif kind in PLANNED:
                    planned[kind] += 1
                elif kind == journal.WATCH_WARNING:
                    warnings[f"{sim.p.name}: {event.get('what')}"] += 1
            return heard

        for i, profile in enumerate(profiles):
            sim = SimRun(root, i, profile, days, ends, t0, deferred)
            client = Recorder(sim.rd.root, lambda _job, sim=sim: sim.start_now())
            sims.append(sim)
            clients.append(client)
            watchers.append(RunWatch(sim.rd, RunState(job_id=sim.job_id), client, cfg,
                                     listeners=[listener(sim)]))
        nodes = {n: Node(n, NodeState.ALLOCATED) for sim in sims for n in sim.nodes}
        cycles = 0
        now = t0
        end = t0 + days * DAY
        while now < end:
            now += cfg.poll_s
            clock[0] = now
            for sim, watch in zip(sims, watchers):
                sim.advance(now)
                watch.step(sim.job(), nodes, now)
            cycles += 1
        calls: Counter = Counter()
        for client in clients:
            for name, args in client.calls:
                start_now = name == "update_pending" and ("start_now", True) in args[1]
                calls["start_now" if start_now else name] += 1
        unexplained = sum(n for name, n in calls.items() if name != "start_now")
        if unexplained and not actions:
            actions.append({"kind": "client_calls", "calls": dict(calls)})
        return ReplayResult(days, len(sims), cycles, sum(s.planned_ends for s in sims), actions,
                            planned, warnings, calls, time.monotonic() - started)
    finally:
        os.fsync = real_fsync
        heartbeat_module.atomic_write_json = real_write  # type: ignore[assignment]
        shutil.rmtree(root, ignore_errors=True)
