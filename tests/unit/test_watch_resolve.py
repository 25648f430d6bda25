"""Which run dirs the watcher accepts: the owner rule and the shape of a run dir."""

from __future__ import annotations

import os
import pwd

import pytest

from slurmft.slurm.client import Job, JobState
from slurmft.watch.resolve import ResolveError, check_owner, current_user, run_dir_for


def job(run_dir=None, user=None) -> Job:
    return Job(job_id="5", name="t", state=JobState.RUNNING, run_dir=run_dir,
               user=user if user is not None else current_user())


def test_a_run_dir_with_a_journal_is_accepted_and_resolved(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_text("")
    assert run_dir_for(job(tmp_path / "run"), None) == (tmp_path / "run").resolve()


def test_an_empty_dir_of_a_job_that_just_started_is_accepted(tmp_path):
    (tmp_path / "run").mkdir()
    assert run_dir_for(job(tmp_path / "run"), None) == (tmp_path / "run").resolve()


@pytest.mark.parametrize("name, make, message", [
    ("etc", lambda p: p.mkdir() or (p / "passwd").write_text("x"), "is not a slurmft run dir"),
    ("link", lambda p: p.symlink_to(p.parent), "is not a directory"),
    ("file", lambda p: p.write_text("x"), "is not a directory"),
    ("missing", lambda p: None, "No such file"),
])
def test_what_is_not_a_run_dir_is_refused_naming_it(tmp_path, name, make, message):
    path = tmp_path / name
    make(path)
    with pytest.raises(ResolveError, match=message):
        run_dir_for(job(path), None)


def test_the_explicit_run_dir_wins_and_must_be_absolute(tmp_path):
    with pytest.raises(ResolveError, match="not an absolute path"):
        run_dir_for(job(tmp_path), os.path.relpath(tmp_path))


def test_no_comment_and_no_flag_says_to_pass_run_dir():
    with pytest.raises(ResolveError, match="pass --run-dir"):
        run_dir_for(job(None), None)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_dir_owned_by_someone_else_is_refused(tmp_path):
    path = tmp_path / "theirs"
    path.mkdir()
    os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(ResolveError, match="not owned by the job's user"):
        run_dir_for(job(path), None)


def test_a_job_of_another_user_is_refused():
    other = "nobody" if current_user() != "nobody" else "root"
    with pytest.raises(ResolveError, match=f"belongs to user {other}"):
        check_owner(job(user=other))


@pytest.mark.parametrize("name", ["watch", "heartbeat", "checkpoints", "events.jsonl"])
def test_a_run_dir_whose_parts_are_symlinks_is_refused(tmp_path, name):
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run" / name).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ResolveError, match="is a symlink"):
        run_dir_for(job(tmp_path / "run"), None)


def test_a_job_that_has_not_started_is_waited_for_until_it_names_its_run_dir(tmp_path):
    # `sbatch` then `slurmft watch JOBID` at once: the job is PENDING and names no run dir yet
    # (the launcher sets the comment when it starts). The watcher once exited 2 here.
    from slurmft.watch.resolve import READY, WAIT, StartWait

    wait = StartWait(["5"], startup_s=300)
    assert wait.judge("5", Job(job_id="5", name="t", state=JobState.PENDING)) == WAIT
    assert wait.judge("5", Job(job_id="5", name="t", state=JobState.RUNNING, run_dir=tmp_path)) == READY
    assert wait.pending == [] and wait.refused == []


@pytest.mark.parametrize("answers, why", [
    ([Job(job_id="5", name="t", state=JobState.PENDING, reason="JobHeldUser")], "is held"),
    ([Job(job_id="5", name="t", state=JobState.FAILED)], "ended (FAILED) without naming a run dir"),
    ([None, None], "no longer listed by Slurm"),
])
def test_a_job_that_can_no_longer_name_a_run_dir_is_given_up_naming_why(answers, why):
    from slurmft.watch.resolve import WAIT, StartWait

    wait = StartWait(["5"], startup_s=300)
    verdicts = [wait.judge("5", a) for a in answers]
    assert verdicts[:-1] == [WAIT] * (len(answers) - 1) and why in verdicts[-1]
    assert "pass --run-dir" in verdicts[-1] and wait.refused == [verdicts[-1]] and wait.pending == []


def test_a_started_job_is_given_a_bounded_time_to_name_its_run_dir():
    # RUNNING, but the launcher has not set the comment yet (python start-up, two scontrol calls).
    from slurmft.watch.resolve import WAIT, StartWait

    now = [0.0]
    wait = StartWait(["5"], startup_s=10.0, clock=lambda: now[0])
    running = Job(job_id="5", name="t", state=JobState.RUNNING)
    assert wait.judge("5", running) == WAIT
    now[0] = 9.0
    assert wait.judge("5", running) == WAIT
    now[0] = 10.0
    assert "has run 10 s without naming a run dir" in wait.judge("5", running)


def test_a_job_waiting_to_start_blocks_no_other_job_from_being_watched(tmp_path):
    """Today: `slurmft watch 5 6` with 6 pending watches nothing, 5 included, until 6 starts."""
    from slurmft.watch.loop import Watcher
    from slurmft.watch.resolve import StartWait

    running = Job(job_id="5", name="t", state=JobState.RUNNING, run_dir=tmp_path)
    listing = {"5": running, "6": Job(job_id="6", name="t", state=JobState.PENDING)}
    stepped: list[str] = []

    class Client:
        def jobs(self, ids):
            return {i: listing[i] for i in ids if i in listing}

        def nodes(self):
            return {}

    class Run:
        def __init__(self, job_id):
            self.job_id, self.active, self.state = job_id, True, None

        def step(self, job, nodes, now):
            stepped.append(job.job_id)

    started = []
    w = Watcher(Client(), [Run("5")], poll_s=1, waiting=StartWait(["6"], 300),
                start=lambda job: started.append(job.job_id) or Run(job.job_id))
    w.cycle()
    assert stepped == ["5"] and started == []
    listing["6"] = Job(job_id="6", name="t", state=JobState.RUNNING, run_dir=tmp_path / "b")
    w.cycle()
    assert started == ["6"] and stepped == ["5", "5", "6"] and w.waiting.pending == []
