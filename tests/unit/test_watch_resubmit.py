"""Resubmitting a job Slurm has forgotten: what is saved at first sight, the new sbatch line,
and no second submission after a watcher restart.

SUBMIT_LINE is accounting's record of a real submission (``sacct -X -P -o SubmitLine`` on the
devcluster, Slurm 22.05.8, captured 2026-11-24 from tests/integration/test_watch_recovery.py),
with the temporary paths replaced by ``{work}``/``{repo}``.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

import pytest

from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobState, SlurmUnavailable
from slurmft.watch import resubmit
from slurmft.watch.config import WatchConfig
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import RunState

from test_watch_runwatch import NODES, T0, RecordingClient, job

SUBMIT_LINE = ("sbatch --parsable --nodes=2 --output={work}/run-job.out --chdir={work} "
               "{repo}/sbatch_templates/train.sbatch {repo}/examples/train_gpt.py --tiny "
               "--global-batch 12 --heartbeat-every 2 --ckpt-every 5 --step-sleep 0.1 --steps 40")
SCRIPT = "#!/bin/bash\n#SBATCH --requeue\necho train\n"


@pytest.fixture
def site(tmp_path):
    repo, work = tmp_path / "repo", tmp_path / "work"
    (repo / "sbatch_templates").mkdir(parents=True)
    (repo / "sbatch_templates" / "train.sbatch").write_text(SCRIPT)
    work.mkdir()
    run = RunDir(work / "run")
    run.root.mkdir()
    return run, SUBMIT_LINE.format(work=work, repo=repo), work


class ResubmitClient(RecordingClient):
    def __init__(self, line: str) -> None:
        super().__init__()
        self.line = line
        self.queue: dict[str, Job] = {}

    def submit_line(self, job_id):
        return self.line

    def batch_script(self, job_id):
        return SCRIPT

    def resubmit(self, argv, *, cwd, env=None):
        self._call("resubmit", tuple(argv), str(cwd), env.get("SLURMFT_RUN_DIR"))
        return "42"

    def user_jobs(self, user):
        return self.queue


def test_the_new_submission_keeps_options_and_arguments_and_uses_the_saved_script(site):
    run, line, work = site
    resubmit.save_record(run, "7", line, str(work), SCRIPT)
    record = resubmit.load_record(run)
    saved = resubmit.SubmitRecord.paths(run)[1]
    assert saved.read_text() == SCRIPT and record.script_index == 5
    argv = resubmit.resubmit_argv(record, saved, run.root, ["n3", "n1"])
    assert argv[:3] == ["--nodes=2", f"--output={work}/run-job.out", f"--chdir={work}"]
    assert argv[3:5] == [f"--comment=SLURMFT_RUN_DIR={run.root}", "--exclude=n[1,3]"]
    assert argv[5] == str(saved) and argv[6].endswith("examples/train_gpt.py")
    assert argv[-2:] == ["--steps", "40"] and "--parsable" not in argv


@pytest.mark.parametrize("line, message", [
    ("srun --nodes=2 x", "not an sbatch command"),
    ("sbatch 'unclosed", "cannot parse"),
    ("sbatch --nodes=2 --output=out.log other.sh", "cannot find the batch script"),
])
def test_a_submit_line_that_cannot_be_replayed_is_refused_naming_why(site, line, message):
    run, _, work = site
    with pytest.raises(resubmit.ResubmitError, match=message):
        resubmit.save_record(run, "7", line, str(work), SCRIPT)


def test_forgotten_job_is_resubmitted_once_and_followed(site):
    run, line, work = site
    client = ResubmitClient(line)
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig())
    w.step(job(work_dir=work), NODES, T0)  # first sight: submission saved
    assert resubmit.load_record(run) is not None
    w.state.node_faults = {"n2": 1}
    w.step(None, NODES, T0 + 900)  # forgotten, run not DONE
    kinds = [c[0] for c in client.calls]
    assert kinds == ["resubmit"]
    argv = client.calls[0][1]
    assert "--exclude=n2" in argv and client.calls[0][3] == str(run.root)
    assert w.job_id == "42" and w.state.phase == "watching"
    resub = [e for e in read_events(run.events) if e.kind == "job_resubmitted"][0]
    assert (resub.get("old_job_id"), resub.get("new_job_id")) == ("7", "42")


def test_a_resubmission_in_flight_when_the_watcher_died_is_found_not_repeated(site):
    run, line, work = site
    client = ResubmitClient(line)
    resubmit.save_record(run, "7", line, str(work), SCRIPT)
    state = RunState(job_id="7", resubmit_started=T0 + 100)
    client.queue = {"43": Job(job_id="43", name="t", state=JobState.PENDING, run_dir=run.root,
                              submit_time=datetime.fromtimestamp(T0 + 101, tz=timezone.utc))}
    w = RunWatch(run, state, client, WatchConfig())
    w.step(None, NODES, T0 + 200)
    assert client.calls == [] and w.job_id == "43"


def test_forgotten_job_without_a_saved_submission_is_reported_lost(site):
    run, _, _ = site
    client = ResubmitClient(None)
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig())
    w.step(None, NODES, T0)
    assert client.calls == [] and w.state.phase == "lost"
    warning = [e for e in read_events(run.events) if e.kind == "watch_warning"][0]
    assert "cannot resubmit" in warning.get("detail")


def test_no_resubmission_while_slurm_cannot_say_whether_the_last_one_went_through(site):
    run, line, work = site
    client = ResubmitClient(line)
    resubmit.save_record(run, "7", line, str(work), SCRIPT)

    def unreachable(user):
        raise SlurmUnavailable("squeue: Unable to contact slurm controller")

    client.user_jobs = unreachable
    w = RunWatch(run, RunState(job_id="7", resubmit_started=T0), client, WatchConfig())
    w.step(None, NODES, T0 + 50)
    assert client.calls == [] and w.job_id == "7"


class ForgettingController(ResubmitClient):
    """The controller no longer lists job 7; accounting says how it ended."""

    def __init__(self, line: str, ended: Job) -> None:
        super().__init__(line)
        self.ended = ended

    def jobs(self, ids):
        return {}

    def nodes(self):
        return NODES

    def job(self, job_id):
        return self.ended


@pytest.mark.parametrize("state, resubmitted", [(JobState.FAILED, True), (JobState.CANCELLED, False)])
def test_a_forgotten_job_its_owner_cancelled_stays_cancelled(site, state, resubmitted):
    """Found on the real controller: a job cancelled while no watcher ran was resubmitted once
    Slurm forgot it; accounting's CANCELLED is the same verdict as the controller's."""
    from slurmft.watch.loop import Watcher

    run, line, work = site
    resubmit.save_record(run, "7", line, str(work), SCRIPT)
    client = ForgettingController(line, job(state, exit_code=0 if state is JobState.CANCELLED else 1))
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig())
    Watcher(client, [w], poll_s=1, clock=lambda: T0).cycle()
    assert [c[0] for c in client.calls] == (["resubmit"] if resubmitted else [])
    if not resubmitted:
        assert w.state.phase == "finished" and w.job_id == "7"
        finished = [e for e in read_events(run.events) if e.kind == "run_finished"]
        assert [e.get("how") for e in finished] == ["cancelled"]


ARRAY_LINE = ("sbatch --parsable --array=0-3%2 --nodes=1 -x n4 --exclude n[5-6] --chdir={work} "
              "{repo}/sbatch_templates/train.sbatch {repo}/examples/train_gpt.py --steps 40")


def test_a_forgotten_array_task_is_resubmitted_alone_with_the_users_exclude_merged(site, tmp_path):
    """Today: the whole array (`--array=0-3%2`) is submitted again, and the appended
    `--exclude=n2` replaces the user's own `-x n4 --exclude n[5-6]` (sbatch keeps the last)."""
    run, _, work = site
    line = ARRAY_LINE.format(work=work, repo=tmp_path / "repo")
    client = ResubmitClient(line)
    w = RunWatch(run, RunState(job_id="12_3"), client, WatchConfig())
    w.step(replace(job(work_dir=work), job_id="12_3"), NODES, T0)
    w.state.node_faults = {"n2": 1}
    w.step(None, NODES, T0 + 900)
    argv = list(client.calls[0][1])
    options = argv[:argv.index(str(resubmit.SubmitRecord.paths(run)[1]))]
    assert [o for o in options if o.startswith(("--array", "-a"))] == ["--array=3"]
    assert [o for o in options if o.startswith(("--exclude", "-x"))] == ["--exclude=n[2,4-6]"]
    assert "n4" not in options and "n[5-6]" not in options
    assert w.job_id == "42_3"  # sbatch prints the array's id; its one task is followed


@pytest.mark.parametrize("value, message", [("/etc/excluded_nodes", "names a file"),
                                            ("n[1-", "not a hostlist")])
def test_a_users_exclude_that_cannot_be_merged_is_refused_naming_it(site, value, message):
    run, line, work = site
    record = resubmit.SubmitRecord("7", line.replace("--nodes=2", f"--nodes=2 --exclude={value}"),
                                   str(work), 6)
    with pytest.raises(resubmit.ResubmitError, match=message):
        resubmit.resubmit_argv(record, resubmit.SubmitRecord.paths(run)[1], run.root, ["n1"])
