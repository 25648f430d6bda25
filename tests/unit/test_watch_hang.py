"""Hang detection never touches a healthy run (issue 25, item 1 and the step-time and clock-skew
parts of item 9): the real heartbeat writer and the real per-run watcher, cycle by cycle on a
simulated clock, with the watcher's DEFAULT settings unless a test says otherwise."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from slurmft.journal import read_events
from slurmft.rundir import RunDir, atomic_write_json
from slurmft.slurm.client import Job, JobState, Node, NodeState
from slurmft.train.heartbeat import Heartbeat
from slurmft.watch import detect
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect import Memory, RunObservation
from slurmft.watch.runview import Beat, JournalSummary
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import RunState

T0 = 1_800_000_000.0
NODES = {n: Node(n, NodeState.ALLOCATED) for n in ("n1", "n2")}
POLL_S = 5.0


class Client:
    """Records every acting call; a healthy run must see none."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def requeue(self, job_id: str) -> bool:
        self.calls.append(("requeue", job_id))
        return True

    def update_pending(self, job_id, **kw) -> None:
        self.calls.append(("update", job_id))

    def hold(self, job_id: str) -> None:
        self.calls.append(("hold", job_id))

    def requeue_hold(self, job_id: str) -> bool:
        self.calls.append(("requeue_hold", job_id))
        return True

    def submit_line(self, job_id: str):
        return None


def running(start: float = T0) -> Job:
    return Job(job_id="7", name="train", state=JobState.RUNNING, nodes=("n1", "n2"), node_count=2,
               start_time=datetime.fromtimestamp(start, tz=timezone.utc))


@pytest.fixture
def run(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    return rd


class Job_:
    """A training job's node leaders: real Heartbeats on one simulated clock (the wall clock of
    each node may lag the watcher's by ``lag``)."""

    def __init__(self, run: RunDir, clock: list[float], lag: float = 0.0, **kw) -> None:
        self.beats = [Heartbeat(run, n, job_id="7", restart_count=0, clock=lambda: clock[0] - lag,
                                monotonic=lambda: clock[0], **kw) for n in NODES]

    def step(self, step: int) -> None:
        for hb in self.beats:
            hb.beat(step)


def drive(watch: RunWatch, clock: list[float], until: float, step_s: float, job: Job_,
          first_step: int = 1, job_state: Job | None = None) -> int:
    """Train at ``step_s`` per step until ``until`` while the watcher polls every POLL_S.
    Returns the next step."""
    step, next_step_at, next_poll = first_step, clock[0] + step_s, clock[0]
    while clock[0] < until:
        if next_step_at <= next_poll:
            clock[0] = next_step_at
            job.step(step)
            step, next_step_at = step + 1, next_step_at + step_s
        else:
            clock[0] = next_poll
            watch.step(job_state or running(), NODES, clock[0])
            next_poll += POLL_S
    return step


def watcher(run: RunDir, client: Client, **cfg) -> RunWatch:
    return RunWatch(run, RunState(job_id="7"), client, WatchConfig(**cfg))


@pytest.mark.parametrize("step_s", [8.0, 30.0, 60.0])
def test_long_steps_with_the_default_cadence_are_not_a_hang(run, step_s):
    # Steps of 8 s beat once every 10 steps with the old cadence: the first beat carried no step
    # time, and 61 s later the run was requeued as hung.
    clock, client = [T0], Client()
    w = watcher(run, client)
    drive(w, clock, T0 + 40 * step_s, step_s, Job_(run, clock))
    assert client.calls == [] and w.state.phase == "watching"
    assert not [e for e in read_events(run.events) if e.kind == "fault_detected"]


def test_the_first_beat_already_teaches_the_timeout(run):
    # One 30 s step, beaten at once with its time: the newest beat of a healthy run at this pace
    # is up to 40 s old, and the timeout learned from that one beat is 10 x 30 s + the cadence.
    clock, client = [T0], Client()
    w = watcher(run, client)
    job = Job_(run, clock)
    clock[0] = T0 + 30
    job.step(1)
    w.step(running(), NODES, clock[0])
    assert w.memory().step_times == (30.0,)
    for late in (100, 250, 370):  # the old watcher: hung at start-up grace + 60 s (T0 + 360)
        w.step(running(), NODES, clock[0] + late)
    assert client.calls == []
    w.step(running(), NODES, T0 + 30 + 10 + 30 + 300 + 30 + 1)  # cadence + step + 10 steps + skew
    assert client.calls and client.calls[0][0] == "requeue"


def test_a_run_that_never_beats_is_not_hung_and_the_watcher_says_so(run, caplog):
    # A CheckpointManager without Run writes no heartbeat: it was requeued as "no heartbeat since
    # the start" however long it had been healthy.
    client = Client()
    w = watcher(run, client)
    with caplog.at_level(logging.WARNING, logger="slurmft.watch.runwatch"):
        for now in range(0, 20000, 300):
            w.step(running(), NODES, T0 + now)
    assert client.calls == [] and w.state.phase == "watching"
    assert "has no heartbeat yet: hang detection starts with its first heartbeat" in caplog.text
    warnings = [e.get("what") for e in read_events(run.events) if e.kind == "watch_warning"]
    assert warnings.count("no_heartbeat") == 1


def test_a_run_that_beat_before_is_judged_when_a_segment_never_starts(run):
    # The other side of the rule: a run that beats, whose new segment is stuck before its first
    # beat, is still found (start-up grace + timeout after the segment started).
    atomic_write_json(run.heartbeat("n1"), {"node": "n1", "job_id": "7", "restart_count": 0,
                                            "step": 5, "time": T0 - 100, "last_step_s": 1.0})
    client = Client()
    w = watcher(run, client)
    job = replace(running(start=T0), restart_count=1)
    w.state.last_restart_count = 1
    w.step(job, NODES, T0 + 300)
    assert client.calls == []
    w.step(job, NODES, T0 + 300 + 90 + 1)
    assert client.calls and client.calls[0][0] == "requeue"


def test_an_unreadable_heartbeat_file_is_could_not_observe_not_absent(run):
    # Only a file of the job's nodes that exists and fails to read stops the judgement; a missing
    # one, or one of another node, does not.
    from slurmft.watch.runview import Heartbeats

    cfg = WatchConfig()
    stale = Beat("n2", "7", 0, 10, T0 - 5000, 1.0, None, interval_s=10)
    beats = Heartbeats({"n2": stale})
    beats.unreadable = frozenset({"n1"})
    obs = RunObservation("7", running(), NODES, JournalSummary(), beats, None, T0 + 10000)
    assert detect.detect_hang(obs, Memory(beats_seen=True), cfg) is None
    beats.unreadable = frozenset({"n9"})
    assert detect.detect_hang(obs, Memory(beats_seen=True), cfg).cause == "hang"


def _read_as_nobody(run: RunDir) -> str:
    """``read_heartbeats(run)`` in a child process that has become user nobody."""
    from slurmft.watch.runview import read_heartbeats

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            from slurmft.watch.filecache import HeartbeatCache

            cache = HeartbeatCache()
            read = [read_heartbeats(run), read_heartbeats(run, cache), read_heartbeats(run, cache)]
            # The cached reader too, and on its next call (an unreadable file is never cached).
            answer = [{"beats": sorted(b), "unreadable": sorted(b.unreadable)} for b in read
                      if b is not None]
            os.write(w, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        text = fh.read()
    os.waitpid(pid, 0)
    return text


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to read the run dir as another user")
def test_the_reader_names_a_heartbeat_file_it_cannot_read():
    # A real unreadable file: mode 000, read by an unprivileged user (root reads anything).
    base = Path(tempfile.mkdtemp(prefix="slurmft-hb-"))
    try:
        os.chmod(base, 0o755)
        run = RunDir(base / "run")
        Heartbeat(run, "n1", job_id="7", restart_count=0).beat(1)
        Heartbeat(run, "n2", job_id="7", restart_count=0).beat(1)
        os.chmod(run.heartbeat("n1"), 0)
        for d in (run.root, run.heartbeat_dir):
            os.chmod(d, 0o755)
        os.chmod(run.heartbeat("n2"), 0o644)
        assert json.loads(_read_as_nobody(run)) == [{"beats": ["n2"], "unreadable": ["n1"]}] * 3
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_a_blocking_phase_longer_than_hang_min_s_is_waited_for_then_judged(run):
    clock, client = [T0], Client()
    w = watcher(run, client)
    job = Job_(run, clock)
    step = drive(w, clock, T0 + 600, 1.0, job)
    saving = [hb.phase("checkpoint save of step 600 (blocking)", bound_s=3660) for hb in job.beats]
    for phase in saving:
        phase.__enter__()
    start = clock[0]
    for now in range(0, 3600, 60):  # an hour-long save, far past hang_min_s
        w.step(running(), NODES, start + now)
    assert client.calls == []
    for phase in saving:
        clock[0] = start + 3600
        phase.__exit__(None, None, None)
    drive(w, clock, start + 4000, 1.0, job, first_step=step)
    assert client.calls == []
    # A save that never ends is judged once its bound (+ the hang timeout) has passed.
    with job.beats[0].phase("checkpoint save", bound_s=600), job.beats[1].phase("checkpoint save", bound_s=600):
        mark = clock[0]
        w.step(running(), NODES, mark + 600 + 60)
        assert client.calls == []
        w.step(running(), NODES, mark + 600 + 90 + 1)
    assert client.calls and client.calls[0][0] == "requeue"


def test_a_checkpoint_load_longer_than_the_start_up_grace_is_waited_for(run):
    # The segment's first beat announces the load (Run creates the heartbeat before it); the
    # start-up grace then starts again when the load ends.
    atomic_write_json(run.heartbeat("n1"), {"node": "n1", "job_id": "7", "restart_count": 0,
                                            "step": 5, "time": T0 - 5000, "last_step_s": 1.0})
    clock, client = [T0 + 20], Client()
    w = watcher(run, client)
    job = Job_(run, clock)
    later = replace(running(T0), restart_count=1)
    for hb in job.beats:
        hb.restart_count = 1
    w.state.last_restart_count = 1
    loads = [hb.phase("checkpoint load", bound_s=3660) for hb in job.beats]
    for phase in loads:
        phase.__enter__()
    for now in range(20, 1500, 30):  # a 25-minute load
        w.step(later, NODES, T0 + now)
    clock[0] = T0 + 1500
    for phase in loads:
        phase.__exit__(None, None, None)
    for now in range(1500, 1500 + 290, 30):  # the first step compiles for almost 5 minutes
        w.step(later, NODES, T0 + now)
    assert client.calls == []


def test_one_long_step_does_not_inflate_timeouts_for_the_rest_of_the_run(run):
    # Heartbeats of an older job (format 1: the mean step since the previous beat, every 10
    # steps): one beat carried an hour (a wall-clock step on the node). The old watcher kept that
    # as the longest step, so a real hang later went unseen for ten hours.
    client = Client()
    w = watcher(run, client)
    now = T0
    for k in range(1, 61):
        now = T0 + 10 * k
        step_s = 3600.0 if k == 20 else 1.0
        for n in NODES:
            atomic_write_json(run.heartbeat(n), {"node": n, "job_id": "7", "restart_count": 0,
                                                 "step": 10 * k, "time": now, "recent_step_s": step_s,
                                                 "every": 10})
        w.step(running(), NODES, now)
    assert client.calls == []
    w.step(running(), NODES, now + 300)  # the job hangs: no beat for 5 minutes
    assert client.calls and client.calls[0][0] == "requeue"


def test_a_phase_label_from_the_run_dir_is_shown_printable(run):
    from slurmft.watch.runview import read_heartbeats

    atomic_write_json(run.heartbeat("n1"), {"node": "n1", "time": T0, "phase": "save\nFAKE LOG LINE",
                                            "phase_bound_s": 60})
    atomic_write_json(run.heartbeat("n2"), {"node": "n2", "time": T0, "phase": "save", "phase_bound_s": -1})
    beats = read_heartbeats(run)
    assert beats["n1"].phase == "save?FAKE LOG LINE" and beats["n1"].phase_bound_s == 60
    assert beats["n2"].phase is None and beats["n2"].phase_bound_s is None  # no usable bound: no phase


def test_clock_skew_of_a_few_seconds_is_allowed(run):
    # Beats every 10 steps of 1 s from a node whose clock lags the watcher's by 10 s; the job
    # pauses 55 s (a slow step, under the 60 s floor). Seen with the watcher's clock the newest
    # beat is 65 s old: the old watcher called that a hang.
    client = Client()
    w = watcher(run, client)
    lag = 10.0
    now = T0
    for k in range(1, 31):
        now = T0 + 10 * k
        for n in NODES:
            atomic_write_json(run.heartbeat(n), {"node": n, "job_id": "7", "restart_count": 0,
                                                 "step": 10 * k, "time": now - lag, "recent_step_s": 1.0,
                                                 "every": 10})
        w.step(running(), NODES, now)
    w.step(running(), NODES, now + 55)
    assert client.calls == []
    w.step(running(), NODES, now - lag + 60 + 30 + 1)  # past the floor + the 30 s allowance
    assert client.calls and client.calls[0][0] == "requeue"
