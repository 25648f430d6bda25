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


def test_a_job_that_has_not_started_is_waited_for_until_it_names_its_run_dir(tmp_path, capsys):
    # `sbatch` then `slurmft watch JOBID` at once: the job is PENDING and names no run dir yet
    # (the launcher sets the comment when it starts). The watcher once exited 2 here.
    from slurmft.watch.resolve import await_run_dirs

    pending = Job(job_id="5", name="t", state=JobState.PENDING)
    started = Job(job_id="5", name="t", state=JobState.RUNNING, run_dir=tmp_path)
    answers = iter([pending, started])
    slept = []
    jobs = await_run_dirs(None, [pending], None, 2.0, once=False, find=lambda c, i: next(answers),
                          sleep=slept.append)
    assert jobs == [started] and slept == [2.0, 2.0]
    assert "waiting for job(s) 5 to start" in capsys.readouterr().err
    assert await_run_dirs(None, [pending], None, 2.0, once=True, find=None) == []   # cron: next cycle
    assert await_run_dirs(None, [pending], tmp_path, 2.0, once=False, find=None) == [pending]  # --run-dir
    held = Job(job_id="6", name="t", state=JobState.PENDING, reason="JobHeldUser")
    assert await_run_dirs(None, [held], None, 2.0, once=False, find=None) == [held]  # not waited for


def test_a_started_job_is_given_a_bounded_time_to_name_its_run_dir(tmp_path):
    # RUNNING, but the launcher has not set the comment yet (python start-up, two scontrol calls).
    from slurmft.watch.resolve import await_run_dirs

    running = Job(job_id="5", name="t", state=JobState.RUNNING)
    named = Job(job_id="5", name="t", state=JobState.RUNNING, run_dir=tmp_path)
    answers = iter([running, named])
    now = [0.0]

    def sleep(s):
        now[0] += s
    assert await_run_dirs(None, [running], None, 2.0, once=False, find=lambda c, i: next(answers),
                          sleep=sleep, clock=lambda: now[0]) == [named]
    never = await_run_dirs(None, [running], None, 2.0, once=False, find=lambda c, i: running,
                           startup_s=10.0, sleep=sleep, clock=lambda: now[0])
    assert never == [running]   # gave it 10 s; the caller then says it names no run dir
