"""Self-requeue: through the Slurm client when the job has scontrol, else a journaled
requeue_request and exit 85; a failing or missing client is never reported as Slurm ending
the job, and never exits 86."""

import pytest

from launch_envs import recorded
from slurmft import exitcodes, journal
from slurmft.journal import read_events
from slurmft.launch import identity, requeue
from slurmft.launch.journaling import Voice
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobState, SlurmError, SlurmUnavailable

pytestmark = pytest.mark.timeout(30)
IDENT = identity.from_environ(recorded("array-task1"))


class Client:
    """An in-memory stand-in for the Slurm client (what it was asked, what it answers)."""

    def __init__(self, job=None, fail=None, comment=""):
        self.job_value = job or Job(job_id="2_1", name="t", state=JobState.RUNNING)
        self.fail = fail or {}
        self.calls = []
        self.comment_text = comment

    def _maybe_fail(self, name):
        if name in self.fail:
            raise self.fail[name]

    def job(self, job_id):
        self.calls.append(("job", job_id))
        self._maybe_fail("job")
        return self.job_value

    def requeue(self, job_id):
        self.calls.append(("requeue", job_id))
        self._maybe_fail("requeue")
        return True

    def update_pending(self, job_id, *, exclude_nodes=(), start_now=False):
        self.calls.append(("update_pending", job_id, tuple(exclude_nodes)))
        self._maybe_fail("update_pending")

    def comment(self, job_id):
        self.calls.append(("comment", job_id))
        self._maybe_fail("comment")
        return self.comment_text

    def set_comment(self, job_id, text):
        self.calls.append(("set_comment", job_id, text))


def _voice(tmp_path):
    return Voice(IDENT, tmp_path)


def _events(tmp_path, kind):
    return read_events(RunDir(tmp_path).events, [kind])


def test_no_scontrol_journals_a_requeue_request_with_the_exclusions(tmp_path):
    code = requeue.requeue_self(None, IDENT, _voice(tmp_path), "pre-flight failed", {"n2": "disk full"})
    assert code == exitcodes.REQUEUE
    [event] = _events(tmp_path, journal.REQUEUE_REQUEST)
    assert event.get("exclude") == ["n2"] and "no scontrol" in event.get("reason")
    assert event.get("job_id") == "2_1" and event.get("raw_job_id") == "2"  # array-aware


def test_requeue_uses_the_array_task_id_and_merges_exclusions(tmp_path):
    client = Client()
    code = requeue.requeue_self(client, IDENT, _voice(tmp_path), "pre-flight failed", {"n2": "x"})
    assert code == exitcodes.REQUEUE
    assert client.calls == [("job", "2_1"), ("requeue", "2_1"), ("update_pending", "2_1", ("n2",))]
    assert [e.get("action") for e in _events(tmp_path, journal.TEMPLATE)] == ["requeue"]


@pytest.mark.parametrize("job", [
    Job(job_id="2_1", name="t", state=JobState.CANCELLED),
    Job(job_id="2_1", name="t", state=JobState.RUNNING, flags=frozenset({"COMPLETING"})),
    Job(job_id="2_1", name="t", state=JobState.RUNNING, restart_count=1),  # a later run exists
])
def test_a_run_slurm_is_ending_is_not_requeued(tmp_path, job):
    client = Client(job=job)
    assert requeue.requeue_self(client, IDENT, _voice(tmp_path), "saved") == exitcodes.REQUEUE
    assert ("requeue", "2_1") not in client.calls
    assert [e.get("action") for e in _events(tmp_path, journal.TEMPLATE)] == ["not_requeued"]


@pytest.mark.parametrize("failing, needle", [
    ("job", "could not read the job"),
    ("requeue", "scontrol requeue failed"),
    ("update_pending", "ExcNodeList not set"),
])
def test_a_failing_client_becomes_a_request_never_a_cancel(tmp_path, failing, needle):
    client = Client(fail={failing: SlurmUnavailable("could not observe: scontrol: no answer")})
    code = requeue.requeue_self(client, IDENT, _voice(tmp_path), "saved", {"n3": "hung"})
    assert code == exitcodes.REQUEUE
    [event] = _events(tmp_path, journal.REQUEUE_REQUEST)
    assert needle in event.get("reason") and event.get("exclude") == ["n3"]
    assert not any(e.get("action") == "not_requeued" for e in _events(tmp_path, journal.TEMPLATE))


def test_comment_keeps_other_text_and_is_set_once(tmp_path):
    client = Client(comment="team=nlp")
    requeue.publish_run_dir(client, IDENT, "/runs/x_1", _voice(tmp_path))
    assert client.calls[-1] == ("set_comment", "2_1", "team=nlp SLURMFT_RUN_DIR=/runs/x_1")
    client = Client(comment="SLURMFT_RUN_DIR=/runs/x_1")
    requeue.publish_run_dir(client, IDENT, "/runs/x_1", _voice(tmp_path))
    assert client.calls == [("comment", "2_1")]


def test_comment_failure_is_a_warning(tmp_path, capsys):
    requeue.publish_run_dir(Client(fail={"comment": SlurmError("squeue: boom")}), IDENT, "/r", _voice(tmp_path))
    assert "WARNING: could not set the job comment" in capsys.readouterr().err


def test_client_only_when_scontrol_is_on_the_jobs_path(tmp_path):
    assert requeue.slurm_client({"PATH": str(tmp_path)}) is None   # a container image without it
    (tmp_path / "scontrol").write_text("#!/bin/sh\n")
    (tmp_path / "scontrol").chmod(0o755)
    assert requeue.slurm_client({"PATH": str(tmp_path)}) is not None


class _Replay:
    """Answers each argv with text (what squeue prints); records every argv."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def run(self, argv, **kwargs):
        from slurmft.slurm.runner import Result

        self.calls.append(tuple(argv))
        return Result(tuple(argv), 0, self.answer, "")


def test_client_comment_calls_take_an_array_task_id_and_refuse_a_multiline_comment():
    from slurmft.slurm.cli import CliSlurmClient
    from slurmft.slurm.client import InvalidArgument

    runner = _Replay("(null)\n")   # what squeue -o %k may print for no comment (the old template
                                   # handled it too)
    cli = CliSlurmClient(runner=runner)
    assert cli.comment("2_1") == ""
    cli.set_comment("2_1", "team=nlp SLURMFT_RUN_DIR=/runs/x_1")
    assert runner.calls == [("squeue", "-h", "-j", "2_1", "-o", "%k"),
                            ("scontrol", "update", "JobId=2_1", "Comment=team=nlp SLURMFT_RUN_DIR=/runs/x_1")]
    with pytest.raises(InvalidArgument, match="one printable line"):
        cli.set_comment("2_1", "a\nb")
    with pytest.raises(InvalidArgument, match="invalid job id"):
        cli.comment("2_1;x")
