"""The watcher and a job in in-allocation mode (issue 27): the launcher recovers a node's death
inside the allocation (a spare, or a smaller world), so the watcher must never requeue or hold
such a run for that death ("never touch a healthy run", issue 25), must still take the requeue
path when the batch host dies or the launcher does not act, excludes the fenced nodes from the
next requeue, and in operator mode sets a fenced node DOWN once Slurm corroborates it.

The run dir is written the way the launcher and the ranks write it: the launcher's journal
events with the contract's fields (``where: "allocation"``, stamped with the array-aware job id,
the raw id and the restart count, as ``launch.journaling.Voice`` stamps them), ``allocation.json``
through ``slurmft.allocation.write``, heartbeats through the ranks' own ``Heartbeat`` writer.
Each test fails on the code before in-allocation mode (the watcher requeued, or called a
restarting world hung)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from slurmft import allocation, journal
from slurmft.allocation import Allocation, Fence
from slurmft.journal import encode_event, read_events
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobState, Node, NodeState
from slurmft.train.heartbeat import Heartbeat
from slurmft.watch.config import WatchConfig
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import RunState, load_state

T0 = 1_800_000_000.0
NODES = ("n1", "n2", "n3", "n4")   # n1 the batch host, n4 the spare


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, tz=timezone.utc)


def job(state=JobState.RUNNING, nodes=NODES, restart=0, **kw) -> Job:
    return Job(job_id="7", name="train", state=state, nodes=nodes, node_count=len(nodes),
               restart_count=restart, start_time=at(0) if state is JobState.RUNNING else None,
               batch_host="n1" if state is JobState.RUNNING else "", raw_job_id="7", **kw)


def table(**states) -> dict[str, Node]:
    """The node table: every node ALLOCATED and answering, but those named (DOWN, NOT_RESPONDING,
    DRAIN...)."""
    nodes = {n: Node(n, NodeState.ALLOCATED) for n in (*NODES, "n5")}
    for name, how in states.items():
        if how == "DOWN":
            nodes[name] = Node(name, NodeState.DOWN, frozenset({"NOT_RESPONDING"}), "Not responding")
        elif how == "NOT_RESPONDING":
            nodes[name] = Node(name, NodeState.ALLOCATED, frozenset({"NOT_RESPONDING"}))
        else:
            nodes[name] = Node(name, NodeState.ALLOCATED, frozenset({"DRAIN"}), how)
    return nodes


class Client:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def requeue(self, job_id):
        self.calls.append(("requeue", job_id))
        return True

    def update_pending(self, job_id, *, exclude_nodes=(), readmit_nodes=(), start_now=False):
        kind = "readmit" if readmit_nodes else "start_now" if start_now else "exclude"
        self.calls.append((kind, job_id, tuple(readmit_nodes or exclude_nodes)))

    def set_down(self, node, reason):
        self.calls.append(("set_down", node, reason))

    def hold(self, job_id):
        self.calls.append(("hold", job_id))

    def requeue_hold(self, job_id):
        self.calls.append(("requeue_hold", job_id))
        return True

    def submit_line(self, job_id):
        return None


@pytest.fixture
def run(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    return rd


def launcher_event(rd: RunDir, kind: str, when: float, restart: int = 0, **fields) -> None:
    """One event as the in-allocation launcher journals it (``launch.journaling.Voice``'s stamp)."""
    stamped = {"job_id": "7", "raw_job_id": "7", "restart_count": restart,
               "where": journal.WHERE_ALLOCATION, **fields}
    with open(rd.events, "ab") as f:
        f.write(encode_event(kind, stamped, now=when))


def rank_event(rd: RunDir, kind: str, when: float, restart: int = 0, **fields) -> None:
    with open(rd.events, "ab") as f:
        f.write(encode_event(kind, {"job_id": "7", "restart_count": restart, **fields}, now=when))


def beat(rd: RunDir, node: str, when: float, step: int = 10, step_s: float = 1.0) -> None:
    """A heartbeat through the ranks' own writer, at wall time ``when``, after a ``step_s`` step."""
    ticks = iter([0.0, step_s])
    hb = Heartbeat(rd, node, job_id="7", restart_count=0, clock=lambda: when,
                   monotonic=lambda: next(ticks, step_s))
    hb.beat(step, force=True)


def node_death(rd: RunDir, when: float, dead: str = "n3", spare: str | None = "n4") -> None:
    """The launcher's record of a node death recovered in the allocation, as
    ``launch/inalloc.py`` journals it: the fault, then one action (``replace_node`` with the
    spare, else ``shrink``: the node is fenced by it, no ``fence`` event of its own)."""
    launcher_event(rd, journal.FAULT_DETECTED, when, cause="node_death", nodes=[dead],
                   evidence=[f"{dead}'s step ended (srun exit 9)"], fault_time=when - 2,
                   detected_by="launcher")
    launcher_event(rd, journal.RECOVERY_ACTION, when + 0.1,
                   action=journal.ALLOC_REPLACE if spare else journal.ALLOC_SHRINK,
                   nodes=[dead], spare=spare, world_nodes=3 if spare else 2, generation=1,
                   cause="node_death", ok=True)


def write_allocation(rd: RunDir, *, fenced=("n3",), spares=(), when: float = T0) -> None:
    active = [n for n in NODES if n not in fenced and n not in spares]
    allocation.write(rd, Allocation(
        job_id="7", generation=len(fenced), active=tuple(active), spares=tuple(spares),
        fenced=tuple(Fence(n, "node_death", when, (f"{n}'s step ended",)) for n in fenced),
        min_nodes=2))


def watcher(rd: RunDir, client: Client, **cfg) -> RunWatch:
    return RunWatch(rd, RunState(job_id="7"), client, WatchConfig(**cfg))


def watcher_faults(rd: RunDir) -> list:
    """What the watcher itself journaled as a fault or an action (the launcher's are not its)."""
    return [e for e in read_events(rd.events, [journal.FAULT_DETECTED, journal.RECOVERY_ACTION,
                                               journal.PLANNED_END, journal.GAVE_UP])
            if not journal.in_allocation(e)]


# -- a node death the launcher recovered: left alone --------------------------------------------

def test_a_fenced_node_down_in_a_running_job_is_left_to_the_launcher(run):
    """n3 died, the launcher fenced it and n4 took its place; Slurm shows n3 DOWN while the job
    runs on (``--no-kill``). The old watcher requeued this healthy run at once."""
    client = Client()
    w = watcher(run, client)
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 50)
    node_death(run, T0 + 60)
    write_allocation(run)
    for node in ("n1", "n2", "n4"):
        beat(run, node, T0 + 75)
    for t in (80, 85, 120, 400):
        for node in ("n1", "n2", "n4"):
            beat(run, node, T0 + t - 1)
        w.step(job(), table(n3="DOWN"), T0 + t)
    assert client.calls == []
    assert watcher_faults(run) == []
    assert load_state(run, "7").phase == "watching"


@pytest.mark.parametrize("source", ["journal", "allocation.json"])
def test_either_record_of_the_fence_is_enough(run, source):
    """The journal's fence event alone (allocation.json unreadable or not written yet), or
    allocation.json alone (the journal's lines lost): the fenced node is the launcher's."""
    client = Client()
    w = watcher(run, client)
    for node in ("n1", "n2", "n4"):
        beat(run, node, T0 + 79)
    if source == "journal":
        node_death(run, T0 + 60)
    else:
        write_allocation(run)
    w.step(job(), table(n3="DOWN"), T0 + 80)
    assert client.calls == [] and watcher_faults(run) == []


def test_a_spare_that_dies_is_warned_about_never_recovered(run):
    """A spare trains nothing: its death costs the run one spare, not a requeue."""
    client = Client()
    w = watcher(run, client)
    write_allocation(run, fenced=(), spares=("n4",))
    for t in (80, 500):
        for node in ("n1", "n2", "n3"):
            beat(run, node, T0 + t - 1)
        w.step(job(), table(n4="DOWN"), T0 + t)
    assert client.calls == []
    (warning,) = read_events(run.events, [journal.WATCH_WARNING])
    assert warning.get("nodes") == ["n4"] and "a spare" in warning.get("detail")


# -- what is still the watcher's: the batch host, a launcher that does not act ------------------

def test_the_batch_hosts_death_still_goes_the_requeue_path_at_once(run):
    client = Client()
    w = watcher(run, client)
    write_allocation(run, fenced=(), spares=("n4",))
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 79)
    w.step(job(), table(n1="DOWN"), T0 + 80)
    assert client.calls == [("requeue", "7")]
    (fault,) = [e for e in watcher_faults(run) if e.kind == journal.FAULT_DETECTED]
    assert fault.get("nodes") == ["n1"] and fault.get("cause") == "node_down"


def test_a_batch_host_slurm_took_out_of_the_job_is_its_death(run):
    """Measured on 22.05 (the alloc lane's devcluster test): under --no-kill the job stays
    RUNNING when its batch host dies, and the DOWN node leaves the job's node list. The old
    watcher saw nothing wrong and requeued only when its hang rule fired (90 s later)."""
    client = Client()
    w = watcher(run, client)
    write_allocation(run, fenced=(), spares=("n4",))
    for node in ("n2", "n3"):
        beat(run, node, T0 + 79)
    w.step(job(nodes=("n2", "n3", "n4")), table(n1="DOWN"), T0 + 80)
    assert client.calls == [("requeue", "7")]
    fault = [e for e in watcher_faults(run) if e.kind == journal.FAULT_DETECTED][0]
    assert fault.get("nodes") == ["n1"] and "batch host" in fault.get("evidence")


def test_an_active_node_the_launcher_does_not_fence_is_recovered_after_the_grace(run):
    """In-allocation mode, n3 DOWN and not fenced: the launcher's to handle for
    allocation_grace_s from when the watcher first saw it DOWN, then the watcher recovers the job
    (a launcher that does not act must not leave a run broken)."""
    client = Client()
    w = watcher(run, client, allocation_grace_s=60)
    write_allocation(run, fenced=(), spares=("n4",))
    for t in (80, 110, 139):
        for node in ("n1", "n2"):
            beat(run, node, T0 + t - 1)
        w.step(job(), table(n3="DOWN"), T0 + t)
    assert client.calls == []
    assert load_state(run, "7").down_since == {"n3": T0 + 80}  # kept for the next watcher (cron)
    beat(run, "n1", T0 + 140)
    w.step(job(), table(n3="DOWN"), T0 + 141)
    assert client.calls == [("requeue", "7")]
    fault = [e for e in watcher_faults(run) if e.kind == journal.FAULT_DETECTED][0]
    assert "did not fence it in 61 s" in fault.get("evidence")


def test_a_node_drained_by_the_sweeper_is_left_to_the_launcher_for_the_grace(run):
    """The launcher polls Slurm's node states and fences an active node the sweeper drained
    (``launch/nodestate.py``): the watcher leaves it to the launcher for allocation_grace_s
    from when it first saw the drain, then recovers the job itself. The old watcher requeued
    at once, racing the launcher's spare."""
    client = Client()
    w = watcher(run, client, allocation_grace_s=60)
    write_allocation(run, fenced=(), spares=("n4",))
    for t in (80, 110, 139):
        for node in ("n1", "n2", "n3"):
            beat(run, node, T0 + t - 1)
        w.step(job(), table(n2="slurmft: gpu: xid 79"), T0 + t)
    assert client.calls == []
    assert load_state(run, "7").down_since == {"n2": T0 + 80}
    beat(run, "n1", T0 + 140)
    w.step(job(), table(n2="slurmft: gpu: xid 79"), T0 + 141)
    assert client.calls == [("requeue", "7")]
    fault = [e for e in watcher_faults(run) if e.kind == journal.FAULT_DETECTED][0]
    assert fault.get("cause") == "node_unhealthy" and "did not fence it in 61 s" in fault.get("evidence")


def test_an_admins_drain_is_left_to_the_launcher_through_its_next_checkpoint(run):
    """An admin's drain (not the sweeper's) is fenced by the launcher only after the run's next
    checkpoint, at most the drain bound (``launch/nodestate.py``): the watcher, whose own rule
    for an admin's drain also acts at that commit, leaves it to the launcher for the bound plus
    allocation_grace_s. The old watcher left it for allocation_grace_s alone, then requeued at
    the commit where the launcher moved onto the spare (checkpoints every 600 s: a real run's)."""
    client = Client()
    w = watcher(run, client, allocation_grace_s=60)
    write_allocation(run, fenced=(), spares=("n4",))
    for when, step in ((T0, 10), (T0 + 600, 20)):
        rank_event(run, journal.CHECKPOINT_COMMITTED, when, step=step, path=f"/c/{step}", tier="shared")
    for t in (700, 800, 1100):
        for node in ("n1", "n2", "n3"):
            beat(run, node, T0 + t - 1, step=25)
        w.step(job(), table(n2="Reboot requested"), T0 + t)
    rank_event(run, journal.CHECKPOINT_COMMITTED, T0 + 1200, step=30, path="/c/30", tier="shared")
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 1204, step=31)
    w.step(job(), table(n2="Reboot requested"), T0 + 1205)
    assert client.calls == []  # the old watcher: [("requeue", "7")]
    # A launcher that never fences it: the watcher recovers the job once the bound (2 x 600 s)
    # and the grace have passed since it first saw the drain.
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 700 + 1200 + 60, step=40)
    w.step(job(), table(n2="Reboot requested"), T0 + 700 + 1200 + 61)
    assert client.calls == [("requeue", "7")]
    end = [e for e in watcher_faults(run) if e.kind == journal.PLANNED_END][0]  # a drain is planned
    assert end.get("cause") == "node_drained" and "did not fence it in 1261 s" in end.get("evidence")


def test_a_drained_node_the_launcher_fenced_is_left_alone(run):
    """The launcher fenced the sweeper-drained n2 and its spare took over: nothing to do, ever."""
    client = Client()
    w = watcher(run, client, allocation_grace_s=60)
    launcher_event(run, journal.FAULT_DETECTED, T0 + 85, cause="node_unhealthy", nodes=["n2"],
                   evidence=["Slurm shows n2 ALLOCATED+DRAIN (slurmft: gpu: xid 79)"],
                   fault_time=T0 + 85, detected_by="launcher")
    launcher_event(run, journal.RECOVERY_ACTION, T0 + 85.1, action=journal.ALLOC_REPLACE, nodes=["n2"],
                   spare="n4", world_nodes=3, generation=1, cause="node_unhealthy", ok=True)
    allocation.write(run, Allocation(job_id="7", generation=1, active=("n1", "n4", "n3"), spares=(),
                                     fenced=(Fence("n2", "node_unhealthy", T0 + 85, ("drained",)),),
                                     min_nodes=3))
    for t in (90, 150, 250):
        for node in ("n1", "n3", "n4"):
            beat(run, node, T0 + t - 1)
        w.step(job(), table(n2="slurmft: gpu: xid 79"), T0 + t)
    assert client.calls == []


def test_the_batch_hosts_drain_is_still_recovered_at_once(run):
    """The batch host cannot be replaced inside the allocation: its drain is the watcher's."""
    client = Client()
    w = watcher(run, client, allocation_grace_s=60)
    write_allocation(run, fenced=(), spares=("n4",))
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 79)
    w.step(job(), table(n1="slurmft: gpu: xid 79"), T0 + 80)
    assert client.calls == [("requeue", "7")]


# -- hang detection across a restart inside the allocation ----------------------------------------

def test_a_world_restarting_in_the_allocation_is_judged_from_its_restart(run):
    """Every worker stops and starts again on a restart in the allocation (torchrun), and the
    checkpoint load before the first step may take minutes: the beats from before the restart
    are the old world's. The old watcher called the run hung hang_min_s after the last old beat;
    now the start-up grace runs from the restart, and past it a restart that never trains is
    still a hang (the safety net when the launcher's recovery itself is stuck)."""
    cfg = dict(hang_min_s=60, clock_skew_s=0, startup_grace_s=300)
    client = Client()
    w = watcher(run, client, **cfg)
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 50)
    w.step(job(), table(), T0 + 55)
    node_death(run, T0 + 60)
    write_allocation(run)
    w.step(job(), table(n3="DOWN"), T0 + 200)   # 150 s since the last beat: no step yet
    w.step(job(), table(n3="DOWN"), T0 + 400)
    assert client.calls == []
    w.step(job(), table(n3="DOWN"), T0 + 60.2 + 300 + 60 + 1)
    assert client.calls == [("requeue", "7")]
    fault = [e for e in watcher_faults(run) if e.kind == journal.FAULT_DETECTED][0]
    assert fault.get("cause") == "hang"


def test_the_new_worlds_beats_are_judged_as_usual_after_the_restart(run):
    """Once the restarted world beats (its segment_start with attempt 1, then steps), a stall
    is found from those beats, as in any segment of the mode: after the hang timeout and the
    allocation_grace_s left to the job's own watchdog."""
    client = Client()
    w = watcher(run, client, hang_min_s=60, clock_skew_s=0, startup_grace_s=300)
    node_death(run, T0 + 60)
    rank_event(run, journal.SEGMENT_START, T0 + 70, attempt=1, world_size=3)
    for node in ("n1", "n2", "n4"):
        beat(run, node, T0 + 80)
    w.step(job(), table(n3="DOWN"), T0 + 100)
    assert client.calls == []
    w.step(job(), table(n3="DOWN"), T0 + 80 + 10 * 1.0 + 1.0 + 60 + 5)  # gap + timeout passed
    assert client.calls == []
    w.step(job(), table(n3="DOWN"), T0 + 80 + 10 * 1.0 + 1.0 + 60 + 60 + 5)  # and the grace
    assert client.calls == [("requeue", "7")]


def test_a_hang_while_training_is_left_to_the_jobs_own_watchdog_for_the_grace(run):
    """In-allocation mode the ranks' step watchdog and torchrun restart a hung world in place;
    the watcher requeues only a hang they did not end within allocation_grace_s. The old watcher
    requeued at the hang timeout (30 s), before the job's watchdog could fire."""
    client = Client()
    w = watcher(run, client, hang_timeout_s=30, clock_skew_s=0, allocation_grace_s=60)
    write_allocation(run, fenced=(), spares=("n4",))
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 79)
    for t in (100, 112, 140, 168):
        w.step(job(), table(), T0 + t)
    assert client.calls == []
    w.step(job(), table(), T0 + 79 + 30 + 60 + 1)
    assert client.calls == [("requeue", "7")]
    fault = [e for e in watcher_faults(run) if e.kind == journal.FAULT_DETECTED][0]
    assert fault.get("cause") == "hang" and "allocation_grace_s 60 s" in fault.get("evidence")


def test_a_hang_the_job_restarted_in_place_is_never_the_watchers(run):
    """The hang as the job journals it: the watchdog fires (rank 1's ``hang``), the launcher
    journals the fault and the restart in place, the new world beats: never requeued."""
    client = Client()
    w = watcher(run, client, hang_timeout_s=30, clock_skew_s=0, allocation_grace_s=60,
                startup_grace_s=120)
    write_allocation(run, fenced=(), spares=("n4",))
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 79)
    w.step(job(), table(), T0 + 100)
    rank_event(run, journal.HANG, T0 + 95, rank=0, node="n1", reason="step 40 ran 15 s")
    launcher_event(run, journal.FAULT_DETECTED, T0 + 96, cause="hang", nodes=["n1"],
                   evidence=["rank 0: step 40 ran 15 s"], fault_time=T0 + 79, detected_by="launcher")
    rank_event(run, journal.SEGMENT_START, T0 + 105, attempt=1, world_size=3, restored_step=35)
    launcher_event(run, journal.RECOVERY_ACTION, T0 + 105.5, action="restart_in_place", nodes=["n1"],
                   spare=None, world_nodes=3, generation=0, cause="hang", ok=True)
    for t in (120, 150, 200, 260):
        for node in ("n1", "n2", "n3"):
            beat(run, node, T0 + t - 1)
        w.step(job(), table(), T0 + t)
    assert client.calls == [] and watcher_faults(run) == []


# -- operator mode: a fenced node DOWN, on two witnesses ------------------------------------------

def test_operator_mode_sets_a_fenced_silent_node_down_with_the_launchers_evidence(run):
    client = Client()
    w = watcher(run, client, operator=True)
    node_death(run, T0 + 60)
    write_allocation(run)
    for t in (70, 76, 82):
        for node in ("n1", "n2", "n4"):
            beat(run, node, T0 + t - 1)
        w.step(job(), table(n3="NOT_RESPONDING"), T0 + t)
    # First sight at 70, two polls by 76: set DOWN once, the job never requeued.
    assert client.calls == [("set_down", "n3", client.calls[0][2])]
    reason = client.calls[0][2]
    assert reason.startswith("slurmft: watch: fenced by job 7's launcher") and "srun exit 9" in reason


def test_operator_mode_never_sets_down_a_fenced_node_that_answers(run):
    """Fenced for a rank crash or a hang, its slurmd alive: no DOWN (it would kill every other
    job on the node on the launcher's word alone)."""
    client = Client()
    w = watcher(run, client, operator=True)
    node_death(run, T0 + 60)
    for t in (70, 76, 82, 200):
        for node in ("n1", "n2", "n4"):
            beat(run, node, T0 + t - 1)
        w.step(job(), table(), T0 + t)
    assert client.calls == []


# -- the next requeue avoids the fenced nodes ---------------------------------------------------

def test_a_later_requeue_excludes_the_nodes_the_launcher_fenced(run):
    """n3 was fenced (node death) in restart 0; then the batch host died and Slurm requeued the
    job: n3 is excluded with the batch host, and counted against it."""
    client = Client()
    w = watcher(run, client)
    node_death(run, T0 + 60)
    for node in ("n1", "n2", "n4"):
        beat(run, node, T0 + 79)
    w.step(job(), table(n3="DOWN"), T0 + 80)
    assert client.calls == []
    w.step(job(state=JobState.PENDING, nodes=(), restart=1), table(n1="DOWN", n3="DOWN"), T0 + 110)
    excluded = [c for c in client.calls if c[0] == "exclude"]
    assert excluded and set(excluded[0][2]) == {"n1", "n3"}
    assert load_state(run, "7").node_faults == {"n1": 1, "n3": 1}


def test_a_spare_the_launcher_fenced_is_left_alone_and_excluded_later(run):
    """A spare's death: the launcher fences it (``fence``, the generation unchanged); Slurm's
    DOWN of it is nothing to act on, and a later requeue avoids it."""
    client = Client()
    w = watcher(run, client)
    launcher_event(run, journal.FAULT_DETECTED, T0 + 60, cause="node_death", nodes=["n4"],
                   evidence=["n4's step ended"], fault_time=T0 + 58, detected_by="launcher")
    launcher_event(run, journal.RECOVERY_ACTION, T0 + 60.1, action=journal.ALLOC_FENCE, nodes=["n4"],
                   spare=None, world_nodes=3, generation=0, cause="node_death", ok=True)
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 79)
    w.step(job(), table(n4="DOWN"), T0 + 80)
    assert client.calls == [] and watcher_faults(run) == []
    w.step(job(state=JobState.PENDING, nodes=(), restart=1), table(n1="DOWN", n4="DOWN"), T0 + 110)
    assert {n for c in client.calls if c[0] == "exclude" for n in c[2]} == {"n1", "n4"}


def test_a_time_limit_requeue_after_a_fence_excludes_the_fenced_node(run):
    """A planned end (the job saved and requeued itself at its time limit) after a fence for a
    hang on a live node: the fenced node is still never used again by this job."""
    client = Client()
    w = watcher(run, client)
    launcher_event(run, journal.FAULT_DETECTED, T0 + 60, cause="hang", nodes=["n2"],
                   evidence=["n2 silent 10 s"], fault_time=T0 + 50, detected_by="launcher")
    launcher_event(run, journal.RECOVERY_ACTION, T0 + 61, action="replace_node", nodes=["n2"],
                   spare="n4", world_nodes=3, generation=1, cause="hang", ok=True)
    for node in ("n1", "n3", "n4"):
        beat(run, node, T0 + 99)
    w.step(job(), table(), T0 + 100)
    rank_event(run, journal.TEMPLATE, T0 + 150, action="requeue",
               reason="training saved and asked to be requeued")
    rank_event(run, journal.SEGMENT_END, T0 + 150, exit_code=85, outcome="requeue")
    w.step(job(state=JobState.PENDING, nodes=(), restart=1), table(), T0 + 160)
    assert ("exclude", "7", ("n2",)) in client.calls


def test_a_fenced_node_is_no_straggler():
    """Seen on the devcluster: after the spare took the dead node's place, the dead node's old
    busy times made it a 'straggler' (a warning, and with exclude_stragglers an exclusion)."""
    from slurmft.watch import detect
    from slurmft.watch.detect import Memory, RunObservation
    from slurmft.watch.runview import JournalSummary

    summary = JournalSummary()
    summary.add(journal.Event(journal.RECOVERY_ACTION, T0, {
        "job_id": "7", "restart_count": 0, "where": journal.WHERE_ALLOCATION,
        "action": journal.ALLOC_REPLACE, "nodes": ["n2"], "spare": "n4"}))
    memory = Memory(node_history={"n1": (1.0, 1.0, 1.0), "n2": (3.0, 3.0, 3.0), "n3": (1.0, 1.0, 1.0)})
    obs = RunObservation("7", job(), table(n2="DOWN"), summary, {}, None, T0 + 10)
    assert detect.detect_straggler(memory, WatchConfig()) is not None  # the rule itself
    assert not [f for f in detect.detect(obs, memory, WatchConfig()) if f.cause == "straggler"]


def test_the_launchers_crash_loop_give_up_is_never_requeued(run):
    """In-allocation mode bounds restarts in place itself: SLURMFT_ALLOC_RESTARTS in a row
    without a newer checkpoint end the job with 86, said in a template ``give_up`` event (no
    segment_end of the ranks says it). The old watcher read a FAILED job with exit 86 and no
    segment_end 86 as a crash, and requeued it."""
    client = Client()
    w = watcher(run, client)
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 79)
    w.step(job(), table(), T0 + 80)
    launcher_event(run, journal.TEMPLATE, T0 + 90, action="give_up",
                   reason="2 restarts in place in a row without a newer checkpoint "
                          "(SLURMFT_ALLOC_RESTARTS=1), the last after a hang")
    ended = job(state=JobState.FAILED, exit_code=86)
    w.step(ended, table(), T0 + 95)
    assert ("requeue", "7") not in client.calls and ("requeue_hold", "7") in client.calls
    (gave_up,) = read_events(run.events, [journal.GAVE_UP])
    assert gave_up.get("cause") == "no_requeue" and "SLURMFT_ALLOC_RESTARTS=1" in gave_up.get("reason")


def test_the_launchers_own_exclusions_are_readmitted_once_repaired_when_the_job_cannot_fit(run):
    """An in-allocation job that lost its spare requeues itself, excluding the nodes it lost
    (its template ``requeue`` event names them). Over a long run those exclusions piled up in
    ExcNodeList until the job could never start again (the 30-minute soak of 2026-11-27: n[4-6]
    excluded, 3 of the 6 nodes left, 4 needed, PENDING BadConstraints for ever). They are
    slurmft's exclusions like the watcher's own: a repaired one is readmitted, oldest first,
    when the job would not fit without it. The old watcher readmitted only its own."""
    client = Client()
    w = watcher(run, client)
    for node in ("n1", "n2", "n3"):
        beat(run, node, T0 + 79)
    w.step(job(), table(), T0 + 80)
    launcher_event(run, journal.TEMPLATE, T0 + 90, action="requeue", exclude="n3,n4",
                   reason="n4 lost (node_silent) and no spare is left: 2 node(s) is below "
                          "SLURMFT_MIN_NODES=3")
    # n3 (fenced earlier) is back in service, n4 still DOWN: without n3, 3 usable nodes of 5.
    pending = job(state=JobState.PENDING, nodes=(), restart=1, min_nodes=4,
                  excluded_nodes=("n3", "n4"))
    w.step(pending, table(n4="DOWN"), T0 + 110)
    assert ("readmit", "7", ("n3",)) in client.calls
    assert ("readmit", "7", ("n4",)) not in client.calls  # still DOWN: it would not help
