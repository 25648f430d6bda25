"""Spares from outside the allocation (``SLURMFT_SPARE_REFILL=1``, issue 27): the settings, the
spare jobs' bookkeeping against a stand-in for the Slurm client (the devcluster test submits and
runs real ones: tests/integration/test_inalloc.py), the spare job's own end (``sparehold``), the
task's adoption of the training job's id, and the supervisor's use of a spare job's node."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from launch_envs import recorded
from slurmft import allocation
from slurmft.launch import (alloc_settings, identity, inalloc, nodesteps, procs, refill, settings,
                            sparehold, task)
from slurmft.launch.journaling import Voice
from slurmft.launch.rendezvous import Rendezvous
from slurmft.launch.settings import SettingsError
from slurmft.launch.signals import SignalLog
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobState, SlurmError

pytestmark = pytest.mark.timeout(60)


def _env(**extra):
    return {**recorded("nonarray"), "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4",
            "SLURM_NNODES": "4", **extra}


def _settings(**extra):
    full = _env(**extra)
    return alloc_settings.from_environ(full, identity.from_environ(full))


# -- settings ----------------------------------------------------------------------------------

def test_the_refill_is_off_by_default_and_asks_for_whole_nodes_when_on():
    assert _settings(SLURMFT_SPARE_NODES="1").refill is False
    on = _settings(SLURMFT_SPARE_NODES="1", SLURMFT_SPARE_REFILL="1")
    assert on.refill and on.spare_sbatch == ("--exclusive",)
    gpus = _settings(SLURMFT_SPARE_NODES="1", SLURMFT_SPARE_REFILL="1",
                     SLURMFT_SPARE_SBATCH="--exclusive --gpus-per-node=8 --constraint='h200|h100'")
    assert gpus.spare_sbatch == ("--exclusive", "--gpus-per-node=8", "--constraint=h200|h100")


@pytest.mark.parametrize("extra, named", [
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_SPARE_REFILL": "yes"}, "SLURMFT_SPARE_REFILL='yes'"),
    ({"SLURMFT_IN_ALLOCATION": "1", "SLURMFT_SPARE_REFILL": "1"}, "set SLURMFT_SPARE_NODES"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_SPARE_REFILL": "1", "SLURMFT_SPARE_SBATCH": "exclusive"},
     "'exclusive' is not an sbatch option"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_SPARE_REFILL": "1", "SLURMFT_SPARE_SBATCH": "--nodes=4"},
     "--nodes is not one of the options"),
    # sbatch takes a unique prefix: --part would be --partition, the launcher's to set
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_SPARE_REFILL": "1", "SLURMFT_SPARE_SBATCH": "--part=x"},
     "--part is not one of the options"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_SPARE_REFILL": "1", "SLURMFT_SPARE_SBATCH": "--wait"},
     "--wait is not one of the options"),
    ({"SLURMFT_SPARE_REFILL": "1"}, "set SLURMFT_SPARE_NODES"),   # the mode off: refused, not ignored
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_SPARE_REFILL": "1", "SLURMFT_SPARE_SBATCH": "--gres='gpu"},
     "cannot be split"),
])
def test_a_bad_refill_setting_is_refused_naming_it(extra, named):
    with pytest.raises(SettingsError, match=named.replace("|", r"\|")):
        _settings(**extra)


# -- the spare jobs' bookkeeping ---------------------------------------------------------------

class Client:
    """What the refill asks of Slurm, answered from a table the test sets."""

    def __init__(self) -> None:
        self.submitted: list[list[str]] = []
        self.cancelled: list[str] = []
        self.killed: list[tuple[str, str]] = []
        self.states: dict[str, Job] = {}
        self.refuse = False

    def job(self, job_id: str) -> Job:
        return Job(job_id, "train", JobState.RUNNING, partition="gpu",
                   time_limit_end=datetime.now(timezone.utc) + timedelta(hours=2))

    def submit(self, script, args=(), *, env=None, sbatch_options=()) -> str:
        if self.refuse:
            raise SlurmError("sbatch: error: Batch job submission failed: Requested node "
                             "configuration is not available")
        assert script.read_bytes() == refill.HOLDER_SCRIPT
        assert env[refill.FOR_ENV] == recorded("nonarray")["SLURM_JOB_ID"]
        self.submitted.append(list(sbatch_options))
        job_id = str(40 + len(self.submitted))
        self.states[job_id] = Job(job_id, refill.HOLDER_NAME, JobState.PENDING)
        return job_id

    def jobs(self, ids):
        return {i: self.states[i] for i in ids if i in self.states}

    def cancel(self, job_id: str, **_) -> None:
        self.cancelled.append(job_id)

    def signal_step(self, job_id: str, step_id: str, signal: str = "KILL") -> None:
        self.killed.append((job_id, step_id))


def _refill(tmp_path, client):
    full = _env(SLURMFT_RUN_DIR=str(tmp_path))
    lines: list[str] = []
    r = refill.Refill(client, identity.from_environ(full), RunDir(tmp_path), full, ("--exclusive",),
                      lines.append, batch_alive=RunDir(tmp_path).alive("n1"), silent_s=5)
    return r, lines


def test_a_spare_job_is_asked_for_once_and_handed_over_when_it_runs(tmp_path):
    client = Client()
    r, lines = _refill(tmp_path, client)
    r.want(1, ["n1", "n2", "n3", "n4", "n5"])
    r._round()
    r._round()   # queued: it counts as coming, nothing asked twice
    [options] = client.submitted
    assert options[:4] == ["--exclusive", "--job-name=slurmft-spare", "--nodes=1", "--ntasks=1"]
    assert "--partition=gpu" in options and "--exclude=n1,n2,n3,n4,n5" in options
    assert "--export=ALL" in options   # an inherited SBATCH_EXPORT=NONE would lose its settings
    minutes = int(next(o for o in options if o.startswith("--time="))[7:])
    assert 124 <= minutes <= 126   # the training job's two hours and the margin: its end is the launcher's
    assert r.pending() == ["41"] and r.take_ready() == []
    client.states["41"] = Job("41", refill.HOLDER_NAME, JobState.RUNNING, nodes=("n7",))
    r._round()
    assert r.take_ready() == [refill.Ready("41", "n7")]
    assert r.pending() == []
    r.want(0, ["n1", "n7"])
    r._round()
    assert len(client.submitted) == 1
    r.cancel("41")
    r._round()
    assert client.cancelled == ["41"]
    assert any("job 41 runs on n7" in line for line in lines)


def test_a_spare_job_that_ends_in_the_queue_is_asked_for_again_and_a_refusal_backs_off(tmp_path):
    client = Client()
    r, lines = _refill(tmp_path, client)
    r.want(1, ["n1"])
    r._round()
    client.states["41"] = Job("41", refill.HOLDER_NAME, JobState.CANCELLED)
    r._round()   # gone: dropped, and asked for again in the same round
    assert len(client.submitted) == 2 and r.pending() == ["42"]
    client.states["42"] = Job("42", refill.HOLDER_NAME, JobState.FAILED)
    client.refuse = True
    r._round()
    r._round()   # refused: not asked again before the back-off
    assert len(client.submitted) == 2
    assert sum("sbatch of a spare job failed" in line for line in lines) == 1
    r.close(wait_s=0)
    assert client.cancelled == []   # nothing of it left to cancel


def test_the_end_cancels_every_spare_job_still_there(tmp_path):
    client = Client()
    r, _ = _refill(tmp_path, client)
    r.want(2, ["n1"])
    r._round()
    r._round()
    client.states["41"] = Job("41", refill.HOLDER_NAME, JobState.RUNNING, nodes=("n7",))
    r._round()
    r.take_ready()
    r.close(wait_s=0)
    assert sorted(client.cancelled) == ["41", "42"]


# -- the spare job's own end -------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _beat(run: RunDir, seq: int) -> None:
    run.alive("n1").parent.mkdir(exist_ok=True)
    run.alive("n1").write_text(json.dumps({"seq": seq, "pid": 7, "step_id": "0"}))


def _record(run: RunDir, job_id: str, spare_jobs) -> None:
    allocation.write(run, allocation.Allocation(job_id=job_id, generation=0, active=("n1", "n2"),
                                                spare_jobs=tuple(spare_jobs)))


def test_the_spare_job_ends_by_itself_once_the_launcher_no_longer_lists_it(tmp_path):
    run, clock = RunDir(tmp_path), Clock()
    _beat(run, 1)
    _record(run, "1234", [allocation.SpareJob("41")])
    hold = sparehold.Hold(run, "1234", "41", run.alive("n1"), 5.0, clock)
    for seq in range(2, 40):   # the launcher beats and lists it: held
        clock.now += 5
        _beat(run, seq)
        assert hold.why_not() is None
    _record(run, "1234", [])   # a new launcher (the job requeued) has spares of its own
    clock.now += sparehold.UNLISTED_S - 1
    _beat(run, 50)
    assert hold.why_not() is None
    clock.now += 2
    _beat(run, 51)
    assert "has not listed this spare job" in hold.why_not()


def test_the_spare_job_ends_by_itself_once_the_batch_host_is_silent(tmp_path):
    run, clock = RunDir(tmp_path), Clock()
    _beat(run, 1)
    _record(run, "99", [])   # another job's record: no reason to end, the pulse decides
    hold = sparehold.Hold(run, "1234", "41", run.alive("n1"), 5.0, clock)
    clock.now += sparehold.PULSE_MIN_S - 1
    assert hold.why_not() is None
    clock.now += 2
    assert "no beat from the training job's batch host" in hold.why_not()


# -- the task in a spare job's allocation ------------------------------------------------------

def test_a_task_in_a_spare_jobs_allocation_names_the_training_job():
    launcher = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3",
                "SLURM_ARRAY_JOB_ID": "1230", "SLURM_ARRAY_TASK_ID": "4"}
    env = {"SLURM_JOB_ID": "41", "SLURM_JOBID": "41", "SLURM_JOB_NODELIST": "n7",
           "SLURM_JOB_NUM_NODES": "1", **refill.step_environ(launcher, "1234", 2)}
    task.adopt_main_job(env)
    assert (env["SLURM_JOB_ID"], env["SLURM_JOBID"], env["SLURM_RESTART_COUNT"]) == ("1234", "1234", "2")
    assert (env["SLURM_JOB_NODELIST"], env["SLURM_JOB_NUM_NODES"]) == ("n[1-3]", "3")
    assert (env["SLURM_ARRAY_JOB_ID"], env["SLURM_ARRAY_TASK_ID"]) == ("1230", "4")
    # An identity check of the launcher's (the array-aware id) reads the training job's.
    assert identity.from_environ({**recorded("nonarray"), **env}).slurm_id == "1230_4"
    untouched = {"SLURM_JOB_ID": "41"}
    task.adopt_main_job(untouched)
    assert untouched == {"SLURM_JOB_ID": "41"}
    stripped = refill.step_env({"SLURM_MEM_PER_NODE": "1000", "SLURM_NTASKS": "4", "PATH": "/bin",
                                "SLURM_CPUS_PER_TASK": "8", "SLURM_GPUS_PER_NODE": "8"})
    assert stripped == {"PATH": "/bin", "SLURM_CPUS_PER_TASK": "8", "SLURM_GPUS_PER_NODE": "8"}


def _refilling_supervisor(tmp_path):
    """A supervisor of n[1-4] (one spare, SLURMFT_SPARE_REFILL=1) and its stand-in client."""
    full = _env(SLURMFT_RUN_DIR=str(tmp_path), SLURMFT_SPARE_NODES="1", SLURMFT_SPARE_REFILL="1")
    ident = identity.from_environ(full)
    client = Client()
    sup = inalloc.Supervisor(ident, settings.from_environ(full, ident),
                             alloc_settings.from_environ(full, ident), Rendezvous("n1", 40001, "r"),
                             ["train.py"], full, SignalLog(), Voice(ident, tmp_path), client,
                             lambda name: None, lambda: None)
    assert sup.refill is not None
    return sup, client


def _supervisor_with_spare_job(tmp_path, monkeypatch, step_code: str = "import time; time.sleep(60)"):
    """A supervisor (n1, n2, n4 active; n3 fenced; no spare of its own left) given the spare job
    41's node n7, whose step is a local process running ``step_code`` (a stand-in for srun);
    (the supervisor, the client, what each node's step was started with)."""
    started: dict[str, tuple[list[str], dict]] = {}

    def start(node, argv, env, run_dir, extra_env=None):
        started[node] = (list(argv), {**env, **(extra_env or {})})
        return nodesteps.NodeStep(node, procs.start([sys.executable, "-c", step_code]), time.monotonic())
    monkeypatch.setattr(nodesteps, "start", start)
    sup, client = _refilling_supervisor(tmp_path)
    sup.alloc = allocation.Allocation(job_id=sup.alloc.job_id, generation=1, active=("n1", "n2", "n4"),
                                      spares=(), fenced=(allocation.Fence("n3", "node_death", None),))
    run = RunDir(tmp_path)
    run.alive("n7").parent.mkdir(exist_ok=True)
    sup._add_spare(refill.Ready("41", "n7"))
    run.alive("n7").write_text(json.dumps({"seq": 1, "pid": 1, "step_id": "0"}))  # its step 0
    sup.liveness.poll()
    return sup, client, started


def test_the_supervisor_starts_a_spare_jobs_node_in_its_allocation_and_fences_it_by_cancelling(
        tmp_path, monkeypatch):
    sup, client, started = _supervisor_with_spare_job(tmp_path, monkeypatch)
    record = allocation.read(RunDir(tmp_path))
    assert record.spares == ("n7",) and record.spare_job_of("n7") == "41"
    argv, env = started["n7"]
    assert argv[:2] == ["srun", "--jobid=41"] and "--nodelist=n7" in argv
    assert env[task.AS_JOB_ENV] == sup.ident.raw_job_id and env["SLURMFT_SPARE_NODE"] == "n7"
    assert sup.liveness.step_id("n7") == "0"
    sup.fence(inalloc.Fault("n7", "node_silent", ["silent"]))
    assert "41" in sup.refill._cancel      # its spare job is cancelled...
    time.sleep(0.2)
    assert client.killed == []             # ...and no KILL of the training job's step 0 sent
    assert sup.refill._next_submit > time.monotonic()  # lost before it trained: backed off
    assert sup.lost([]) == ["n3"]          # never released from the training job: not its node
    assert "n7" not in sup.steps


def test_a_spare_jobs_node_whose_step_ended_is_fenced_and_its_job_cancelled(tmp_path, monkeypatch):
    """The reaped path: its srun ended by itself (the node died, the spare job ended)."""
    sup, client, _ = _supervisor_with_spare_job(tmp_path, monkeypatch, "import sys; sys.exit(1)")
    sup.fence(inalloc.Fault("n2", "rank_crash", ["ended"]), reaped=True)  # n7 takes n2's place
    assert sup.alloc.active == ("n1", "n7", "n4")
    sup.refill._next_submit = 0.0
    deadline = time.monotonic() + 10
    with pytest.raises(inalloc.GoRequeue) as lost:   # no spare left below SLURMFT_MIN_NODES=3
        while time.monotonic() < deadline:
            sup._reap()
            time.sleep(0.05)
    assert "n7 lost (node_death)" in lost.value.reason and "41" in sup.refill._cancel
    assert sup.refill._next_submit == 0.0    # it trained: no back-off
    # The requeue excludes the spare job's node but never releases it from the training job.
    assert "n7" in sup.exclusions(lost.value.exclude) and sorted(sup.lost(list(lost.value.exclude))) == ["n2", "n3"]
    sup.stop_all()                           # and every spare job is cancelled on the way out
    assert "41" in sup.refill.client.cancelled


def test_the_supervisor_lists_a_queued_spare_job_until_it_ends_in_the_queue(tmp_path):
    sup, client = _refilling_supervisor(tmp_path)
    sup.alloc = allocation.Allocation(job_id=sup.alloc.job_id, generation=1, active=("n1", "n2", "n4"),
                                      fenced=(allocation.Fence("n3", "node_death", None),))
    sup._refill()                     # one spare short: the refill is told so
    sup.refill._round()               # ...and asks Slurm
    assert client.submitted and "--exclude=n1,n2,n3,n4" in client.submitted[0]
    sup._refill()
    assert allocation.read(RunDir(tmp_path)).spare_jobs == (allocation.SpareJob("41"),)
    client.states["41"] = Job("41", refill.HOLDER_NAME, JobState.CANCELLED)
    client.refuse = True              # the next one is refused: nothing queued
    sup.refill._round()
    sup._refill()
    assert allocation.read(RunDir(tmp_path)).spare_jobs == ()


def test_a_spare_job_that_runs_when_no_spare_is_wanted_any_more_is_cancelled(tmp_path):
    sup, client = _refilling_supervisor(tmp_path)
    assert sup.alloc.spares == ("n4",)   # its own spare still waits
    sup.refill._ready.append(refill.Ready("41", "n7"))
    sup._refill()
    assert "41" in sup.refill._cancel and "n7" not in sup.alloc.spares


def test_a_fenced_spare_jobs_node_ends_its_hold_and_a_late_cancel_is_tried_again(tmp_path):
    run, clock = RunDir(tmp_path), Clock()
    _beat(run, 1)
    allocation.write(run, allocation.Allocation(
        job_id="1234", generation=1, active=("n1", "n2"), fenced=(allocation.Fence("n7", "node_silent", None),),
        spare_jobs=(allocation.SpareJob("41", "n7"),)))
    hold = sparehold.Hold(run, "1234", "41", run.alive("n1"), 5.0, clock, node="n7")
    assert "fenced this node (n7)" in hold.why_not()

    class Refusing(Client):
        def cancel(self, job_id, **_):
            raise SlurmError("scancel: error: Socket timed out")
    r, lines = _refill(tmp_path, Refusing())
    r.cancel("41")
    r._round()
    assert "41" in r._cancel    # kept: tried again next round, and at the end
    assert any("could not cancel the spare job 41" in line for line in lines)


def test_a_spare_job_on_a_node_to_avoid_is_never_handed_over_and_is_cancelled(tmp_path):
    client = Client()
    r, _ = _refill(tmp_path, client)
    r.want(1, ["n1", "n3"])
    r._round()
    client.states["41"] = Job("41", refill.HOLDER_NAME, JobState.RUNNING, nodes=("n3",))
    r._round()
    assert r.take_ready() == [] and "41" not in r.pending()   # another asked for instead
    r._round()
    assert client.cancelled == ["41"]
