"""A run dir is a run, not a job: the watcher's state is the run dir's, with one epoch per job
that ran in it (``watch/state.py``), taken on by ``slurmft watch`` (``commands/watch.py``)."""

from __future__ import annotations

import json

import pytest

from slurmft.commands.watch import EXIT_SLURM, EXIT_USAGE, RunFactory, WatchStartError
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobNotFound, JobState, SlurmUnavailable
from slurmft.watch.config import WatchConfig
from slurmft.watch.resolve import current_user
from slurmft.watch.state import (
    GAVE_UP, NEW_EPOCH, WATCHING, Epoch, RunState, StateError, load_state, save_state, take_on,
)


def job(job_id: str, state=JobState.RUNNING, run_dir=None, **kw) -> Job:
    return Job(job_id=job_id, name="train", state=state, user=current_user(), run_dir=run_dir, **kw)


class Client:
    """Slurm's view of each job by id; an id missing is one Slurm forgot."""

    def __init__(self, jobs: dict[str, Job], error: Exception | None = None) -> None:
        self.jobs, self.error = jobs, error

    def job(self, job_id: str) -> Job:
        if self.error is not None:
            raise self.error
        if job_id not in self.jobs:
            raise JobNotFound(f"job {job_id} not found")
        return self.jobs[job_id]


@pytest.fixture
def run(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    (rd.root / "events.jsonl").write_text("")
    return rd


def factory(client) -> RunFactory:
    return RunFactory(client, WatchConfig(), [], None, None)


def worn_state(job_id: str) -> RunState:
    """The state a watcher leaves after a job that had trouble and was given up on."""
    return RunState(job_id=job_id, phase=GAVE_UP, reason="crash loop", restarts=4,
                    restarts_by_cause={"crash": 4}, node_faults={"n2": 2}, ckpt_at_recovery=[10, 10, 10],
                    last_restart_count=4, last_nodes=["n1", "n2"], excluded=["n2"],
                    warned=["straggler:n3"], announced=True)


def test_a_later_job_in_the_same_run_dir_starts_a_new_epoch(run):
    """Today: exit 2 'run dir ... is watched for job 100' until someone deletes state.json."""
    save_state(run, worn_state("100"))
    client = Client({"100": job("100", JobState.FAILED), "200": job("200", run_dir=run.root)})
    f = factory(client)
    watched = f.make(client.jobs["200"])
    f.release()
    st = watched.state
    assert watched.job_id == "200" and [e.job_id for e in st.epochs] == ["100", "200"]
    # What judged job 100 starts afresh ...
    assert (st.phase, st.reason, st.restarts, st.restarts_by_cause, st.ckpt_at_recovery) == \
        (WATCHING, "", 0, {}, [])
    assert (st.last_restart_count, st.last_nodes, st.excluded, st.warned, st.announced) \
        == (None, [], [], [], False)
    # ... what the watcher learned about the nodes is kept, and the new epoch is on disk.
    assert st.node_faults == {"n2": 2}
    assert [e.job_id for e in load_state(run, "200").epochs] == ["100", "200"]


def test_a_new_job_while_the_runs_current_job_lives_is_refused_naming_it(run):
    save_state(run, RunState(job_id="100"))
    client = Client({"100": job("100", JobState.PENDING, reason="JobHeldAdmin"),
                     "200": job("200", run_dir=run.root)})
    with pytest.raises(WatchStartError) as err:
        factory(client).make(client.jobs["200"])
    assert err.value.code == EXIT_USAGE
    assert "belongs to job 100, which is still PENDING (held)" in str(err.value)
    assert load_state(run, "200").job_id == "100"  # nothing changed


def test_a_new_job_when_slurm_cannot_say_whether_the_current_one_ended_is_not_taken_on(run):
    save_state(run, RunState(job_id="100"))
    client = Client({}, error=SlurmUnavailable("slurmctld down"))
    with pytest.raises(WatchStartError) as err:
        factory(client).make(job("200", run_dir=run.root))
    assert err.value.code == EXIT_SLURM and "cannot tell whether job 100" in str(err.value)
    assert load_state(run, "200").job_id == "100"


def test_a_resubmitted_job_is_followed_under_its_old_id(run):
    """Today: after the watcher resubmitted forgotten job 100 as 300, `slurmft watch 100` (the
    systemd unit restarting) exits 2 and stays stopped."""
    state = RunState(job_id="100", restarts=2, restarts_by_cause={"crash": 2})
    state.resubmitted("300", 1.0)
    save_state(run, state)
    client = Client({"100": job("100", JobState.FAILED, run_dir=run.root),
                     "300": job("300", run_dir=run.root)})
    f = factory(client)
    watched = f.make(client.jobs["100"])
    f.release()
    assert watched.job_id == "300"
    assert watched.state.restarts == 2  # a resubmission continues its epoch
    assert watched.state.epochs[-1] == Epoch("300", 1.0, resubmitted_from="100")


def test_a_job_from_an_earlier_epoch_finds_the_run_and_its_current_job(run):
    state = RunState(job_id="100")
    state.new_epoch("200", 5.0)
    save_state(run, state)
    client = Client({"200": job("200", run_dir=run.root)})
    f = factory(client)
    assert f.make(job("100", JobState.COMPLETED, run_dir=run.root)).job_id == "200"
    f.release()


def test_the_job_a_dying_watcher_resubmitted_is_its_epoch_not_a_new_one(run):
    state = RunState(job_id="100", restarts=3, resubmit_started=50.0)
    how = take_on(state, "300", 60.0, lambda: pytest.fail("no need to ask Slurm"))
    assert how == "resubmission" and state.restarts == 3 and state.resubmit_started is None
    assert state.epochs[-1].resubmitted_from == "100"


def test_state_of_version_1_is_read_as_one_epoch(run):
    """The state files watchers wrote before epochs (version 1) still load."""
    run.watch_state.parent.mkdir()
    v1 = {"version": 1, "job_id": "100", "phase": "finished", "restarts": 1,
          "restarts_by_cause": {"crash": 1}, "node_faults": {"n1": 1}, "ckpt_at_recovery": [5],
          "last_restart_count": 1, "last_nodes": ["n1"], "excluded": [], "max_step_s": 1.5,
          "max_beat_gap_s": 15.0, "recovery": None, "warned": [], "reason": "",
          "resubmit_started": None, "announced": True}
    run.watch_state.write_text(json.dumps(v1))
    state = load_state(run, "200")
    assert state.epochs == [Epoch("100")] and state.restarts == 1
    assert take_on(state, "200", 9.0, lambda: None) == NEW_EPOCH
    save_state(run, state)
    assert json.loads(run.watch_state.read_text())["version"] == 2


@pytest.mark.parametrize("epochs", [[], "100", [{"job_id": 100}], [{"job_id": "9"}],
                                    [{"job_id": "100", "spy": 1}], [{"job_id": "100", "since": "NaN"}],
                                    [{"job_id": "100", "since": True}]])
def test_epochs_that_do_not_fit_the_state_are_a_clear_error(run, epochs):
    save_state(run, RunState(job_id="100"))
    data = json.loads(run.watch_state.read_text())
    data["epochs"] = epochs
    run.watch_state.write_text(json.dumps(data).replace('"NaN"', "NaN"))
    with pytest.raises(StateError, match="epochs|unreadable"):
        load_state(run, "100")


class UserClient(Client):
    """``--all``'s listing of the user's jobs, the node table, and what is asked of Slurm."""

    def __init__(self, jobs: dict[str, Job]) -> None:
        super().__init__(jobs)
        self.calls: list[tuple] = []

    def user_jobs(self, user: str) -> dict[str, Job]:
        return dict(self.jobs)

    def nodes(self):
        return {}

    def submit_line(self, job_id: str):
        return None


def test_all_lets_go_of_an_ended_run_and_takes_on_the_next_job_in_its_run_dir(run, tmp_path):
    """Today: the finished run is kept (its lock held, its series exported) for the watcher's
    life, and the next job in the same run dir is refused ('two of the jobs write the same run
    dir')."""
    from slurmft.watch.loop import Watcher
    from slurmft.watch.metrics import WatchMetrics
    from slurmft.watch.metrics_feed import MetricsFeed
    from slurmft.watch.state import RunLock

    client = UserClient({"100": job("100", run_dir=run.root)})
    f = factory(client)
    metrics = WatchMetrics()
    feed = MetricsFeed(metrics, None)
    f.listeners.append(metrics.on_event)
    w = Watcher(client, [], poll_s=1, user=current_user(), adopt=f.adopt, let_go=f.let_go,
                forget=feed.forget, on_cycle=feed.after_cycle)
    w.cycle()
    assert [r.job_id for r in w.runs] == ["100"]
    assert b'slurmft_watch_run_active{slurm_job="100"} 1.0' in metrics.text()

    client.jobs["100"] = job("100", JobState.COMPLETED, run_dir=run.root)
    w.cycle()
    assert w.runs == [] and f.locks == {}
    RunLock(run).acquire()  # released: another watcher may take the run dir now
    assert b'slurmft_watch_run_active{slurm_job="100"} 0.0' in metrics.text()  # still listed

    client.jobs = {"200": job("200", run_dir=run.root)}  # 100 left the queue; 200 in the same dir
    f2 = factory(client)
    w.adopt, w.let_go = f2.adopt, f2.let_go
    f2.listeners.append(metrics.on_event)
    w.cycle()
    assert b'slurm_job="100"' not in metrics.text()  # Slurm no longer lists it: forgotten
    assert [r.job_id for r in w.runs] == []  # the other watcher (the lock above) has it
    f2.release()


def test_all_takes_on_the_next_job_in_the_run_dir_of_a_run_it_let_go(run):
    from slurmft.watch.loop import Watcher

    client = UserClient({"100": job("100", run_dir=run.root)})
    f = factory(client)
    w = Watcher(client, [], poll_s=1, user=current_user(), adopt=f.adopt, let_go=f.let_go)
    w.cycle()
    client.jobs["100"] = job("100", JobState.COMPLETED, run_dir=run.root)
    w.cycle()
    client.jobs["200"] = job("200", run_dir=run.root)
    w.cycle()
    assert [r.job_id for r in w.runs] == ["200"]
    assert [e.job_id for e in w.runs[0].state.epochs] == ["100", "200"]
    f.release()


def test_all_adopts_again_a_run_it_gave_up_on_once_its_job_is_released(run):
    from slurmft.watch.loop import Watcher

    save_state(run, RunState(job_id="100", phase=GAVE_UP, reason="crash loop", restarts=3))
    held = job("100", JobState.PENDING, run_dir=run.root, reason="JobHeldUser")
    client = UserClient({"100": held})
    f = factory(client)
    w = Watcher(client, [], poll_s=1, user=current_user(), adopt=f.adopt, let_go=f.let_go)
    w.cycle()
    w.cycle()
    assert w.runs == [] and f.locks == {}  # given up on, held: let go, lock free
    client.jobs["100"] = job("100", JobState.PENDING, run_dir=run.root, reason="Priority")
    w.cycle()
    assert [r.state.phase for r in w.runs] == [WATCHING] and w.runs[0].state.restarts == 0
    f.release()


def test_all_takes_on_a_job_seen_while_the_run_dirs_last_job_still_ended(run):
    """The next job (e.g. submitted with the run dir in its --comment, or started the moment the
    last one ended) shows up while the run is still watched for the job before it: it is asked
    for again each cycle, not dropped for good."""
    from slurmft.watch.loop import Watcher

    client = UserClient({"100": job("100", run_dir=run.root)})
    f = factory(client)
    w = Watcher(client, [], poll_s=1, user=current_user(), adopt=f.adopt, let_go=f.let_go)
    w.cycle()
    client.jobs["200"] = job("200", JobState.PENDING, run_dir=run.root)
    w.cycle()  # 100 still runs: 200 waits
    assert [r.job_id for r in w.runs] == ["100"]
    client.jobs["100"] = job("100", JobState.COMPLETED, run_dir=run.root)
    w.cycle()  # 100 ends (let go at the end of the cycle); 200 was refused at its start
    w.cycle()
    assert [r.job_id for r in w.runs] == ["200"]
    f.release()
