"""Backend choice (pyslurm vs CLI), the pyslurm backend over a stand-in module, and the
state-based requeue policy shared by both backends."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest

from slurmft.slurm import backend, policy
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import Job, JobNotFound, JobState, NodeState, SlurmError, SlurmInfo, SlurmUnavailable
from slurmft.slurm.config import SlurmConfig


# -- a stand-in for pyslurm 25.x (there is no real pyslurm for Slurm 22.05) -----------------------

def fake_pyslurm(version="25.11.0", jobs=(), nodes=()):
    mod = types.ModuleType("pyslurm")
    mod.__version__ = version
    calls = []
    mod.calls = calls

    class RPCError(Exception):
        pass

    class Job:
        def __init__(self, job_id=None, **attrs):
            self.id = job_id
            self.__dict__.update(attrs)

        @staticmethod
        def load(job_id):
            calls.append(("Job.load", job_id))
            for j in jobs:
                if j.id == job_id:
                    return j
            raise RPCError("Invalid job id specified")

        def modify(self, desc):
            calls.append(("Job.modify", self.id, dict(desc.__dict__)))

        def send_signal(self, sig, steps="children"):
            calls.append(("Job.send_signal", self.id, sig, steps))

        def cancel(self):
            calls.append(("Job.cancel", self.id))

        def hold(self):
            calls.append(("Job.hold", self.id))

        def release(self):
            calls.append(("Job.release", self.id))

    class Jobs(dict):
        @staticmethod
        def load():
            calls.append(("Jobs.load",))
            return {j.id: j for j in jobs}

    class Node:
        def __init__(self, name=None, **kwargs):
            self.name = name
            self.__dict__.update(kwargs)

        def modify(self, changes):
            calls.append(("Node.modify", self.name, dict(changes.__dict__)))

    class Nodes(dict):
        @staticmethod
        def load():
            calls.append(("Nodes.load",))
            return {n.name: n for n in nodes}

    class JobSubmitDescription:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    mod.RPCError, mod.Job, mod.Jobs, mod.Node, mod.Nodes = RPCError, Job, Jobs, Node, Nodes
    mod.JobSubmitDescription = JobSubmitDescription
    return mod


def ps_job(mod, job_id, state, **over):
    attrs = dict(name="train", state=state, state_reason="None", allocated_nodes="n[1-2]", num_nodes=2,
                 max_nodes=0, excluded_nodes="n7", requeue_count=1, exit_code=0, exit_code_signal=0,
                 submit_time=1795386000, eligible_time=1795386000, start_time=1795386010, end_time=None,
                 partition="debug", user_name="alice", working_directory="/w",
                 comment="SLURMFT_RUN_DIR=/runs/x", is_requeueable=True)
    attrs.update(over)
    return mod.Job(job_id, **attrs)


@pytest.fixture
def running_2511(monkeypatch):
    monkeypatch.setattr(CliSlurmClient, "info", lambda self: SlurmInfo(version=(25, 11, 1)))


def test_no_pyslurm_means_cli(monkeypatch, running_2511):
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # import fails
    assert backend.import_pyslurm() is None
    assert isinstance(backend.get_client(SlurmConfig()), CliSlurmClient)


def test_matching_pyslurm_is_used(monkeypatch, running_2511):
    monkeypatch.setitem(sys.modules, "pyslurm", fake_pyslurm("25.11.0"))
    client = backend.get_client(SlurmConfig())
    assert type(client).__name__ == "PyslurmClient"
    assert client.info().extra == {"backend": "pyslurm", "pyslurm": "25.11.0"}


def test_mismatched_pyslurm_falls_back_silently_unless_asked_for(monkeypatch, running_2511):
    monkeypatch.setitem(sys.modules, "pyslurm", fake_pyslurm("24.11.2"))
    assert isinstance(backend.get_client(SlurmConfig()), CliSlurmClient)
    with pytest.raises(SlurmError, match=r"built for Slurm 24.11, the running Slurm is 25.11"):
        backend.get_client(SlurmConfig(backend="pyslurm"))


def test_cli_backend_never_imports_pyslurm(monkeypatch):
    monkeypatch.setattr(backend, "import_pyslurm", lambda: pytest.fail("imported pyslurm"))
    assert isinstance(backend.get_client(SlurmConfig(backend="cli")), CliSlurmClient)


def test_env_overlay_with_other_slurm_conf_keeps_cli(monkeypatch, running_2511):
    monkeypatch.setitem(sys.modules, "pyslurm", fake_pyslurm("25.11.0"))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    client = backend.get_client(SlurmConfig(), env={"SLURM_CONF": "/tmp/dev/slurm.conf"})
    assert isinstance(client, CliSlurmClient)


def make_pyslurm_client(mod):
    from slurmft.slurm.pyslurm import PyslurmClient

    return PyslurmClient(mod, SlurmConfig(retries=1, backoff=0, max_backoff=0), cli=CliSlurmClient(), sleep=lambda s: None)


def test_pyslurm_jobs_convert_and_use_one_load():
    mod = fake_pyslurm()
    mod_jobs = [ps_job(mod, 5, "RUNNING"), ps_job(mod, 6, "FAILED", exit_code=3, end_time=1795386100),
                ps_job(mod, 7, "COMPLETING")]
    mod = fake_pyslurm(jobs=mod_jobs)
    client = make_pyslurm_client(mod)
    jobs = client.jobs(["5", "6", "7", "8"])
    assert mod.calls == [("Jobs.load",)]
    assert jobs["5"].state is JobState.RUNNING and jobs["5"].nodes == ("n1", "n2") and jobs["5"].exit_code is None
    assert jobs["5"].run_dir.as_posix() == "/runs/x" and jobs["5"].restart_count == 1 and jobs["5"].reason == ""
    assert jobs["6"].state is JobState.FAILED and jobs["6"].exit_code == 3 and jobs["6"].end_time is not None
    assert jobs["7"].completing and "8" not in jobs


def test_pyslurm_actions_and_errors():
    mod = fake_pyslurm()
    mod = fake_pyslurm(jobs=[ps_job(mod, 9, "PENDING", allocated_nodes="", start_time=None)],
                       nodes=[mod.Node("n1", state="IDLE+DRAIN", reason="slurmft: x", reason_user="root")])
    client = make_pyslurm_client(mod)
    client.update_pending("9", exclude_nodes=["n3", "n2"], start_now=True)
    assert mod.calls[-1] == ("Job.modify", 9, {"excluded_nodes": "n[2-3,7]", "begin_time": "now"})
    client.cancel("9", signal="USR2", batch_only=True)
    assert mod.calls[-1] == ("Job.send_signal", 9, "SIGUSR2", "batch")
    client.drain("n1", "bad\ngpu")
    assert mod.calls[-1] == ("Node.modify", "n1", {"name": None, "state": "DRAIN", "reason": "bad gpu"})
    node = client.nodes(["n1"])["n1"]
    assert node.state is NodeState.IDLE and node.drained and node.reason_user == "root"
    with pytest.raises(JobNotFound):
        mod.calls.clear()
        client._call("Job.load", lambda: mod.Job.load(404))
    assert mod.calls == [("Job.load", 404)]  # permanent: not retried

    def down():
        raise mod.RPCError("Unable to contact slurm controller (connect failure)")
    with pytest.raises(SlurmUnavailable, match="could not observe"):
        client._call("Jobs.load", down)


# -- the requeue policy ---------------------------------------------------------------------------

BASE = Job(job_id="1", name="t", state=JobState.RUNNING)


@pytest.mark.parametrize("state,flags,action", [
    (JobState.PENDING, (), policy.RequeueAction.ALREADY_PENDING),
    (JobState.COMPLETED, (), policy.RequeueAction.REFUSE_COMPLETED),
    (JobState.RUNNING, (), policy.RequeueAction.INCOMPLETE),
    (JobState.RUNNING, ("COMPLETING",), policy.RequeueAction.WAIT),
    (JobState.FAILED, (), policy.RequeueAction.PLAIN),
    (JobState.NODE_FAIL, (), policy.RequeueAction.PLAIN),
    (JobState.TIMEOUT, (), policy.RequeueAction.PLAIN),
    (JobState.REQUEUED, (), policy.RequeueAction.IMPOSSIBLE),
])
def test_requeue_action(state, flags, action):
    assert policy.requeue_action(replace(BASE, state=state, flags=frozenset(flags))) is action


@pytest.mark.parametrize("state", [JobState.RUNNING, JobState.FAILED])
def test_no_requeue_jobs_are_refused_before_asking_slurm(state):
    job = replace(BASE, state=state, requeue_allowed=False)
    assert policy.requeue_action(job) is policy.RequeueAction.NOT_REQUEUEABLE
    with pytest.raises(SlurmError, match="--no-requeue"):
        policy.requeue_by_state(lambda: job, lambda inc: pytest.fail("requeued"), wait_s=1)


def run_policy(states):
    seen, actions = list(states), []

    def fetch():
        return replace(BASE, state=seen.pop(0)) if len(seen) > 1 else replace(BASE, state=seen[0])
    result = policy.requeue_by_state(fetch, actions.append, wait_s=1, sleep=lambda s: None)
    return result, actions


def test_requeue_running_uses_incomplete():
    assert run_policy([JobState.RUNNING, JobState.PENDING]) == (True, [True])


def test_requeue_race_running_then_completed_is_refused():
    # Incomplete was a no-op because the job completed meanwhile: never follow with a plain requeue
    assert run_policy([JobState.RUNNING, JobState.COMPLETED]) == (False, [True])


def test_requeue_race_running_then_failed_gets_plain_requeue():
    assert run_policy([JobState.RUNNING, JobState.FAILED]) == (True, [True, False])


def test_requeue_completed_and_pending_do_nothing():
    assert run_policy([JobState.COMPLETED]) == (False, [])
    assert run_policy([JobState.PENDING]) == (True, [])


def test_requeue_waits_on_completing_then_gives_up():
    job = replace(BASE, flags=frozenset({"COMPLETING"}))
    with pytest.raises(SlurmUnavailable, match="still COMPLETING"):
        policy.requeue_by_state(lambda: job, lambda inc: pytest.fail("requeued"), wait_s=0.01, sleep=lambda s: None)


# -- a change that got no answer ----------------------------------------------------------------

def test_requeue_that_timed_out_but_happened_is_reported_as_done_and_not_sent_again():
    from slurmft.slurm.client import OutcomeUnknown

    states = [replace(BASE, restart_count=2),  # before: running
              replace(BASE, flags=frozenset({"COMPLETING"}), restart_count=3),  # it did land
              replace(BASE, state=JobState.PENDING, restart_count=3)]
    sent = []

    def requeue(incomplete):
        sent.append(incomplete)
        raise OutcomeUnknown("scontrol requeue: Socket timed out on send/recv operation")
    assert policy.requeue_by_state(lambda: states.pop(0) if len(states) > 1 else states[0], requeue,
                                   wait_s=5, sleep=lambda s: None) is True
    assert sent == [True]


def test_requeue_fast_restarted_job_counts_by_restart_count_not_state():
    """With --requeue=expedite the job may already RUN again when it is re-read."""
    from slurmft.slurm.client import OutcomeUnknown

    states = [replace(BASE, restart_count=0), replace(BASE, restart_count=1)]

    def requeue(incomplete):
        raise OutcomeUnknown("no answer within 20 s")
    assert policy.requeue_by_state(lambda: states.pop(0) if len(states) > 1 else states[0], requeue,
                                   wait_s=5, sleep=lambda s: None) is True


def test_requeue_that_timed_out_and_did_not_happen_is_sent_again_then_given_up():
    from slurmft.slurm.client import OutcomeUnknown

    sent = []

    def requeue(incomplete):
        sent.append(incomplete)
        raise OutcomeUnknown("scontrol requeue: Socket timed out on send/recv operation")
    with pytest.raises(OutcomeUnknown, match="Socket timed out"):
        policy.requeue_by_state(lambda: replace(BASE, state=JobState.FAILED), requeue, wait_s=5,
                                sleep=lambda s: None)
    assert sent == [False, False]


def test_change_confirmed_reads_back_before_sending_again():
    from slurmft.slurm.client import OutcomeUnknown

    sent, landed = [], [True]

    def change():
        sent.append(1)
        raise OutcomeUnknown("Socket timed out")
    policy.change_confirmed(change, lambda: landed[0])
    assert sent == [1]
    landed[0] = False
    with pytest.raises(OutcomeUnknown):
        policy.change_confirmed(change, lambda: landed[0])
    assert len(sent) == 3

    def unreadable():
        raise SlurmUnavailable("could not observe: squeue: Unable to contact slurm controller")
    with pytest.raises(OutcomeUnknown, match="re-reading the state to check failed too"):
        policy.change_confirmed(change, unreadable)


@pytest.mark.timeout(20)
def test_pyslurm_a_hung_call_does_not_block_the_next_ones():
    import threading

    from slurmft.slurm.pyslurm import MAX_HUNG, PyslurmClient

    mod = fake_pyslurm(nodes=[fake_pyslurm().Node("n1", state="IDLE", reason="", reason_user="")])
    client = PyslurmClient(mod, SlurmConfig(timeout=0.2, retries=0), cli=CliSlurmClient(),
                           sleep=lambda s: None)
    wedged = threading.Event()
    try:
        with pytest.raises(SlurmUnavailable, match="no answer within 0.2 s"):
            client._call("Nodes.load", wedged.wait)  # libslurm stuck (e.g. on a dead controller)
        assert set(client.nodes()) == {"n1"}  # the next call is not queued behind it
        for _ in range(MAX_HUNG - 1):
            with pytest.raises(SlurmUnavailable):
                client._call("Nodes.load", wedged.wait)
        with pytest.raises(SlurmUnavailable, match=f"{MAX_HUNG} earlier libslurm calls never returned"):
            client.nodes()
    finally:
        wedged.set()


def test_pyslurm_a_drain_that_got_no_answer_is_read_back_not_sent_again():
    from slurmft.slurm.client import OutcomeUnknown

    mod = fake_pyslurm()
    node = mod.Node("n1", state="IDLE", reason="", reason_user="")
    mod = fake_pyslurm(nodes=[node])
    client = make_pyslurm_client(mod)
    modify = mod.Node.modify

    def times_out_but_lands(self, changes):
        modify(self, changes)
        node.state, node.reason = "IDLE+DRAIN", changes.reason
        raise mod.RPCError("Socket timed out on send/recv operation")
    mod.Node.modify = times_out_but_lands
    client.drain("n1", "slurmft: gpu_ecc: 2 DBE")
    assert [c[0] for c in mod.calls] == ["Node.modify", "Nodes.load"]

    def times_out(self, changes):
        modify(self, changes)
        raise mod.RPCError("Socket timed out on send/recv operation")
    mod.Node.modify = times_out
    mod.calls.clear()
    with pytest.raises(OutcomeUnknown, match="it may have taken effect"):
        client.resume("n1")  # never lands: sent twice (read back in between), then reported
    assert [c[0] for c in mod.calls] == ["Node.modify", "Nodes.load", "Node.modify", "Nodes.load"]


def test_requeue_re_read_before_the_unanswered_send_landed_then_refused_counts_as_done():
    """slurmctld serves RPCs in threads: the re-read can come before the queued requeue."""
    from slurmft.slurm.client import OutcomeUnknown

    states = [replace(BASE, state=JobState.FAILED), replace(BASE, state=JobState.FAILED),
              replace(BASE, state=JobState.PENDING, restart_count=1)]
    sent = []

    def requeue(incomplete):
        sent.append(incomplete)
        if len(sent) == 1:
            raise OutcomeUnknown("scontrol requeue: no answer within 20 s")
        raise SlurmError("scontrol requeue: Job is pending execution for job 1")
    assert policy.requeue_by_state(lambda: states.pop(0) if len(states) > 1 else states[0], requeue,
                                   wait_s=5, sleep=lambda s: None) is True
    assert sent == [False, False]


def test_change_confirmed_a_refused_resend_after_no_answer_is_checked_against_the_state():
    from slurmft.slurm.client import OutcomeUnknown

    answers = [OutcomeUnknown("Socket timed out"), SlurmError("Invalid node state specified")]
    landed = [False, True]  # not yet at the first re-read, by the time the resend is refused

    def change():
        raise answers.pop(0)
    policy.change_confirmed(change, lambda: landed.pop(0))
    with pytest.raises(SlurmError, match="Invalid node name"):  # no earlier send: the error stands
        policy.change_confirmed(lambda: (_ for _ in ()).throw(SlurmError("Invalid node name")),
                                lambda: True)


@pytest.mark.parametrize("state, flags, ok", [
    (JobState.PENDING, (), True),
    (JobState.RUNNING, ("COMPLETING",), True),   # 22.05: requeued while its batch script ends
    (JobState.RUNNING, (), False),
    (JobState.FAILED, ("COMPLETING",), False),   # really ending: Slurm would refuse it
    (JobState.CANCELLED, ("COMPLETING",), False),
])
def test_an_exclusion_is_sent_only_to_a_job_slurm_takes_it_for(state, flags, ok):
    assert policy.excludable_now(replace(BASE, state=state, flags=frozenset(flags))) is ok
