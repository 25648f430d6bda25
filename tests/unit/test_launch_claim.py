"""The run dir's claim (``slurmft/launch/claim.py``): a run dir is refused only when another live
job or array task really holds it, whatever the path's spelling."""

from __future__ import annotations

import json
import os
import threading

import pytest

from launch_envs import recorded
from slurmft.launch import identity, settings
from slurmft.launch.claim import ClaimRefused, claim_run_dir, read_claim
from slurmft.rundir import RunDir

TASK0, TASK1 = identity.from_environ(recorded("array-task0")), identity.from_environ(recorded("array-task1"))
JOB = identity.from_environ(recorded("nonarray"))


def other_job(job_id: str, raw: str | None = None):
    env = {**recorded("nonarray"), "SLURM_JOB_ID": raw or job_id}
    return identity.from_environ(env)


@pytest.fixture
def run(tmp_path):
    (tmp_path / "run").mkdir()
    return tmp_path / "run"


def test_a_wrapper_that_gives_each_task_its_own_dir_is_not_refused_for_its_spelling():
    """Today: exit 86 'shared by every task of array job 2: put %a in it' on every task."""
    env = {**recorded("array-task1"), "SLURMFT_RUN_DIR": "/runs/sweep/task_1"}
    assert settings.from_environ(env, TASK1).run_dir.as_posix() == "/runs/sweep/task_1"
    env["SLURMFT_RUN_DIR"] = "/runs/x_%A_%a"  # the spelling still works
    assert settings.from_environ(env, TASK1).run_dir.as_posix() == "/runs/x_2_1"


def test_each_task_claims_its_own_dir(tmp_path):
    for ident, name in ((TASK0, "task_0"), (TASK1, "task_1")):
        (tmp_path / name).mkdir()
        claim = claim_run_dir(tmp_path / name, ident, lambda job_id: True)
        assert claim.job_id == ident.slurm_id
        assert read_claim(RunDir(tmp_path / name).claim) == claim


def test_two_tasks_in_one_dir_the_second_is_refused_naming_the_first(run):
    claim_run_dir(run, TASK0, lambda job_id: True)
    asked = []
    with pytest.raises(ClaimRefused) as err:
        claim_run_dir(run, TASK1, lambda job_id: asked.append(job_id) or True)
    assert err.value.code == 86 and asked == [TASK0.slurm_id]
    assert str(err.value) == (f"run dir {run} is claimed by job 2_0 (task 0 of array job 2), which is "
                              "still alive: every job and array task needs its own run dir")
    assert read_claim(RunDir(run).claim).job_id == "2_0"


def test_the_same_job_requeued_keeps_its_claim(run):
    first = claim_run_dir(run, JOB, lambda job_id: pytest.fail("its own claim needs no question"))
    assert claim_run_dir(run, JOB, None) == first


def test_an_ended_jobs_claim_is_taken_over(run):
    claim_run_dir(run, other_job("100"), lambda job_id: True)
    claim = claim_run_dir(run, other_job("200"), lambda job_id: False)
    assert claim.job_id == "200" and read_claim(RunDir(run).claim) == claim
    assert sorted(os.listdir(run)) == ["claim.json"]  # nothing left aside


def test_when_slurm_cannot_be_asked_the_job_is_passed_on_not_given_up(run):
    claim_run_dir(run, other_job("100"), lambda job_id: True)
    with pytest.raises(ClaimRefused) as err:
        claim_run_dir(run, other_job("200"), lambda job_id: None)
    assert err.value.code == 1 and "could not be asked" in str(err.value)


def test_without_scontrol_a_sibling_task_refuses_and_an_earlier_job_is_followed(run, tmp_path):
    claim_run_dir(run, TASK0, None)
    with pytest.raises(ClaimRefused, match="claimed by job 2_0"):
        claim_run_dir(run, TASK1, None)
    (tmp_path / "seq").mkdir()
    claim_run_dir(tmp_path / "seq", other_job("100"), None)
    assert claim_run_dir(tmp_path / "seq", other_job("200"), None).job_id == "200"


@pytest.mark.parametrize("content", [b"not json", b"[]", json.dumps({"version": 1, "job_id": 5}).encode(),
                                     json.dumps({"version": 9}).encode()])
def test_a_claim_that_is_not_one_is_refused_naming_the_file(run, content):
    (run / "claim.json").write_bytes(content)
    with pytest.raises(ClaimRefused, match="claim.json: not a slurmft run dir claim"):
        claim_run_dir(run, JOB, lambda job_id: False)


def test_a_claim_that_is_a_link_is_refused(run, tmp_path):
    (tmp_path / "elsewhere").write_text("{}")
    (run / "claim.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ClaimRefused, match="cannot be read as a claim"):
        claim_run_dir(run, JOB, lambda job_id: False)


def test_two_jobs_taking_over_one_ended_claim_at_once_end_with_one_owner(run):
    claim_run_dir(run, other_job("100"), lambda job_id: True)
    contenders = [other_job(str(300 + i)) for i in range(8)]
    won, refused = [], []
    barrier = threading.Barrier(len(contenders))

    def take(ident):
        barrier.wait()
        try:
            won.append(claim_run_dir(run, ident, lambda job_id: job_id != "100"))
        except ClaimRefused as exc:
            refused.append(exc)

    threads = [threading.Thread(target=take, args=(i,)) for i in contenders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == 1 and len(refused) == len(contenders) - 1
    assert read_claim(RunDir(run).claim) == won[0]
