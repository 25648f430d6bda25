"""Parser tests per Slurm release: 22.05 (captured here) and 23.02-25.11 (published output)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.slurm.client import JobNotFound, JobState, NodeState, SlurmError
from slurmft.slurm.jsonshape import meta_release
from slurmft.slurm.parse_jobs import parse_sacct, parse_sacct_text, parse_squeue
from slurmft.slurm.parse_nodes import parse_nodes

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
PUB = FIXTURES / "published"
CAP = FIXTURES / "2205"


def read(path: Path) -> str:
    return path.read_text()


# -- 22.05: our own captures -------------------------------------------------------------------

def by_state(jobs):
    return {j.state: j for j in jobs}


def test_2205_running_failed_completed():
    jobs = by_state(parse_squeue(read(CAP / "squeue_running_failed_completed.json")))
    running, failed, done = jobs[JobState.RUNNING], jobs[JobState.FAILED], jobs[JobState.COMPLETED]
    assert running.nodes == ("n1", "n2") and running.node_count == 2
    assert running.run_dir == Path("/shared/runs/demo")
    assert running.exit_code is None and running.end_time is None and running.start_time is not None
    # squeue 22.05 prints the raw wait status 768 for "exit 3"
    assert failed.exit_code == 3 and failed.exit_signal is None and failed.reason == "NonZeroExitCode"
    assert done.exit_code == 0 and done.end_time is not None


def test_2205_a_pending_one_task_array_is_known_by_its_task_id():
    """sbatch --array=5 (how the watcher resubmits a forgotten array task alone): pending, the
    record has no array_task_id, only array_task_string "5"; its task id is 1_5. An array of
    several tasks (0-1) stays one record under the array's id until Slurm splits it."""
    jobs = {j.job_id: j for j in parse_squeue(read(CAP / "squeue_array_pending.json"))}
    assert set(jobs) == {"1_5", "2"}
    assert jobs["1_5"].state is JobState.PENDING and jobs["1_5"].raw_job_id == "1"


def test_2205_running_job_with_a_time_limit_says_when_it_ends():
    # end_time stays None until the job finished; the limit's end is its own field (the launcher
    # judges an early USR2 by it). An unlimited job (start + 1 year in Slurm's end_time) has none.
    (limited,) = parse_squeue(read(CAP / "squeue_running_time_limit.json"))
    assert limited.state is JobState.RUNNING and limited.end_time is None
    assert (limited.time_limit_end - limited.start_time).total_seconds() == 300
    unlimited = by_state(parse_squeue(read(CAP / "squeue_running_failed_completed.json")))[JobState.RUNNING]
    assert unlimited.time_limit_end is None


def test_2205_a_running_job_names_its_batch_host_and_a_pending_one_none():
    """The batch host's death ends even a ``--no-kill`` job (issue 27): the watcher must know it."""
    (limited,) = parse_squeue(read(CAP / "squeue_running_time_limit.json"))
    assert limited.batch_host == "n1"
    pending = next(j for j in parse_squeue(read(CAP / "squeue_requeued_pending.json")) if j.run_dir)
    assert pending.batch_host == ""


def test_2205_requeued_job_is_pending_begintime_with_eligible_time_ahead():
    jobs = parse_squeue(read(CAP / "squeue_requeued_pending.json"))
    job = next(j for j in jobs if j.run_dir is not None)
    assert job.state is JobState.PENDING and job.reason == "BeginTime"
    assert job.restart_count == 1 and job.nodes == () and job.start_time is None
    delay = (job.eligible_time - job.submit_time).total_seconds()
    assert 100 <= delay <= 130


def test_2205_sacct_json_misreports_exit_3_but_text_is_right():
    from_json = {j.job_id: j for j in parse_sacct(read(CAP / "sacct_failed_exit3.json")) if j.state is JobState.FAILED}
    from_text = {j.job_id: j for j in parse_sacct_text(read(CAP / "sacct_text_history.txt")) if j.state is JobState.FAILED}
    (job_id,) = from_text
    assert from_text[job_id].exit_code == 3
    assert from_json[job_id].exit_code == 0  # Slurm 22.05's bug, which is why the client uses text there


def test_2205_sacct_history_orders_runs_and_counts_restarts():
    records = parse_sacct_text(read(CAP / "sacct_text_history.txt"))
    requeued_id = next(j.job_id for j in records if j.state is JobState.REQUEUED)
    runs = [j for j in records if j.job_id == requeued_id]
    assert [r.state for r in runs] == [JobState.REQUEUED, JobState.PENDING]
    assert [r.restart_count for r in runs] == [0, 1]
    assert runs[0].nodes == ("n1", "n2") and runs[1].nodes == () and runs[1].start_time is None


def test_history_with_unchanged_submit_time_puts_the_pending_run_last():
    # 24.11 keeps SubmitTime across a requeue; the run that has not started yet is the newest.
    text = ("7|t|PENDING|BeginTime|0:0|1795386884|1795387009|Unknown|Unknown|None assigned|2|debug|root|/w|\n"
            "7|t|REQUEUED|None|0:0|1795386884|1795386884|1795386886|1795386888|n[1-2]|2|debug|root|/w|\n")
    runs = parse_sacct_text(text)
    assert [(r.state, r.restart_count) for r in runs] == [(JobState.REQUEUED, 0), (JobState.PENDING, 1)]


def test_2205_nodes_drained_and_down():
    nodes = parse_nodes(read(CAP / "sinfo_drain_down.json"), "sinfo --json")
    assert nodes["n3"].drained and nodes["n3"].reason.startswith("slurmft: gpu:")
    assert nodes["n3"].reason_user == "root"
    assert nodes["n4"].down and not nodes["n4"].responding
    assert nodes["n1"].state is NodeState.IDLE and not nodes["n1"].flags


# -- 24.11 (v0.0.42) and 26.05 (v0.0.45): captured in the test matrix's trixie and sid rootfs ------

MATRIX_CAPTURES = pytest.mark.parametrize("cap", [FIXTURES / "2411", FIXTURES / "2605"], ids=["24.11", "26.05"])


@MATRIX_CAPTURES
def test_matrix_running_failed_and_requeued(cap):
    jobs = by_state(parse_squeue(read(cap / "squeue_running_failed.json")))
    running, failed = jobs[JobState.RUNNING], jobs[JobState.FAILED]
    assert running.nodes == ("n1", "n2") and running.run_dir == Path("/shared/runs/demo")
    assert failed.exit_code == 3 and failed.exit_signal is None
    (pending,) = parse_squeue(read(cap / "squeue_requeued_pending.json"))
    assert pending.state is JobState.PENDING and pending.reason == "BeginTime" and pending.restart_count == 1
    assert 100 <= (pending.eligible_time - pending.submit_time).total_seconds() <= 130


@MATRIX_CAPTURES
def test_matrix_sacct_requeued_run_is_pending_plus_requeued(cap):
    records = parse_sacct(read(cap / "sacct_history.json"))
    by_id: dict[str, list] = {}
    for record in records:
        by_id.setdefault(record.job_id, []).append(record)
    first, second = next(runs for runs in by_id.values() if len(runs) == 2)
    assert first.state is JobState.REQUEUED and first.nodes == ("n1", "n2") and first.restart_count == 0
    assert second.state is JobState.PENDING and second.restart_count == 1 and second.start_time is None
    failed = next(r for r in records if r.state is JobState.FAILED)
    assert failed.exit_code == 3  # right from 23.02 on (22.05 says 0)


@MATRIX_CAPTURES
def test_matrix_scontrol_nodes_drain(cap):
    nodes = parse_nodes(read(cap / "scontrol_nodes_drain.json"), "scontrol --json show nodes")
    assert nodes["n3"].drained and nodes["n3"].reason == "slurmft: gpu: xid 79"
    assert not nodes["n1"].flags and nodes["n1"].state is NodeState.IDLE


# -- 23.02 .. 25.11: published real output ------------------------------------------------------

RELEASES = {
    "23.02": "v0.0.39", "23.11": "v0.0.40", "24.05": "v0.0.41", "24.11": "v0.0.42",
    "25.05": "v0.0.43", "25.11": "v0.0.44",
}


@pytest.mark.parametrize("release,parser", sorted(RELEASES.items()))
def test_running_job(release, parser):
    text = read(PUB / release / parser / "slurmrestd__slurm-job-running.json")
    (job,) = parse_squeue(text)
    assert job.state is JobState.RUNNING and job.nodes and job.node_count == len(job.nodes)
    assert job.exit_code is None and job.end_time is None
    assert job.start_time >= job.submit_time
    version, data_parser = meta_release(__import__("json").loads(text))
    assert f"{version[0]}.{version[1]:02d}" == release and data_parser == parser


@pytest.mark.parametrize("release,parser", [(r, p) for r, p in sorted(RELEASES.items()) if r != "23.02"])
def test_failed_job_exit_code(release, parser):
    (job,) = parse_squeue(read(PUB / release / parser / "slurmrestd__slurm-job-failed.json"))
    assert job.state is JobState.FAILED and job.exit_code == 1 and job.exit_signal is None
    assert job.reason == "NonZeroExitCode" and job.end_time is not None


@pytest.mark.parametrize("release,parser", [(r, p) for r, p in sorted(RELEASES.items()) if r != "23.02"])
def test_sacct_failed_record(release, parser):
    (job,) = parse_sacct(read(PUB / release / parser / "slurmrestd__slurmdb-job-failed.json"))
    assert job.state is JobState.FAILED and job.exit_code == 1 and job.nodes
    assert job.restart_count == 0


def test_2302_string_states_and_plain_int_times():
    (pending,) = parse_squeue(read(PUB / "23.02/v0.0.39/slurmrestd__slurm-job-pending.json"))
    assert pending.state is JobState.PENDING and pending.reason == "Resources"
    assert pending.min_nodes == 16 and pending.start_time is None  # Slurm's estimate is dropped
    (done,) = parse_squeue(read(PUB / "23.02/v0.0.39/slurmrestd__slurm-job-completed.json"))
    assert done.state is JobState.COMPLETED and done.exit_code == 0 and len(done.nodes) == 64
    (acct,) = parse_sacct(read(PUB / "23.02/v0.0.39/slurmrestd__slurmdb-job-completed.json"))
    assert acct.state is JobState.COMPLETED and acct.exit_code == 0


def test_2311_timeout_is_a_signal_not_an_exit_code():
    (job,) = parse_squeue(read(PUB / "23.11/v0.0.40/slurmrestd__slurm-job-timeout.json"))
    assert job.state is JobState.TIMEOUT and job.exit_code is None and job.exit_signal == 15


def test_2411_pending_begintime():
    (job,) = parse_squeue(read(PUB / "24.11/v0.0.42/slurmrestd__slurm-job-pending.json"))
    assert job.state is JobState.PENDING and job.reason == "BeginTime" and job.nodes == ()


def test_2511_multi_node_job_nodes_expanded():
    (job,) = parse_squeue(read(PUB / "25.11/v0.0.44/slurmrestd__slurm-job-gpus-multi-nodes.json"))
    assert job.node_count == len(job.nodes) >= 2 and all("[" not in n for n in job.nodes)


@pytest.mark.parametrize("path", [
    "23.11/v0.0.40/slurmrestd__slurm-job-unfound.json",
    "25.11/v0.0.44/slurmrestd__slurm-job-unfound.json",
])
def test_unfound_job_document_raises_not_empty(path):
    with pytest.raises(JobNotFound, match="Invalid job id specified"):
        parse_squeue(read(PUB / path), "scontrol --json show job")


def test_2205_sacct_nothing_found_is_no_record():
    """22.05's sacct --json for a job accounting has no record of says "Nothing found" as an
    error (9003); that is no record (the job is unknown to accounting), not a failed call."""
    assert parse_sacct(read(CAP / "sacct_nothing_found.json"), "sacct --json -D") == []


@pytest.mark.parametrize("release,parser", sorted(RELEASES.items()))
def test_sacct_without_a_record_is_no_record_on_every_release(release, parser):
    assert parse_sacct(read(PUB / release / parser / "slurmrestd__slurmdb-job-unfound.json")) == []


def test_any_other_accounting_error_still_raises():
    doc = __import__("json").loads(read(CAP / "sacct_nothing_found.json"))
    doc["errors"].append({"error": "Unable to contact slurmdbd", "error_number": 7000})
    with pytest.raises(SlurmError, match="Nothing found with query"):
        parse_sacct(__import__("json").dumps(doc))


@pytest.mark.parametrize("path,name,state,flags,reason", [
    ("23.02/v0.0.39/slurmrestd__slurm-node-drain.json", "cn051", NodeState.IDLE, {"DRAIN"}, "ECC memory error"),
    ("23.02/v0.0.39/slurmrestd__slurm-node-down.json", "cn084", NodeState.DOWN, set(), "CPU dead"),
    ("23.11/v0.0.40/slurmrestd__slurm-node-drain.json", "cn1", NodeState.IDLE, {"DRAIN"}, "ECC memory error"),
    ("24.05/v0.0.41/slurmrestd__slurm-node-draining.json", "cn1", NodeState.MIXED, {"DRAIN"}, "ECC memory error"),
    ("24.11/v0.0.42/slurmrestd__slurm-node-drain.json", "cn4", NodeState.IDLE, {"DRAIN"}, "ECC memory error"),
    ("25.05/v0.0.43/slurmrestd__slurm-node-down.json", "cn1", NodeState.DOWN, set(), "CPU dead"),
    ("25.11/v0.0.44/slurmrestd__slurm-node-draining.json", "cn1", NodeState.MIXED, {"DRAIN"}, "ECC memory error"),
    ("25.11/v0.0.44/cli__scontrol_show_node_json__charmed_25.11.0.json", "compute-0", NodeState.DOWN,
     {"DYNAMIC_NORM"}, "Not responding"),
])
def test_nodes(path, name, state, flags, reason):
    nodes = parse_nodes(read(PUB / path), "scontrol --json show nodes")
    node = nodes[name]
    assert node.state is state and node.flags == frozenset(flags) and node.reason == reason


def test_real_sacct_cli_outputs_parse():
    for path in ("23.02/v0.0.39/cli__sacct_json__mila_23.02.6.json",):
        jobs = parse_sacct(read(PUB / path))
        assert jobs and all(j.state is not None for j in jobs)


@pytest.mark.parametrize("release,parser", [("23.11", "v0.0.40"), ("24.05", "v0.0.41")])
def test_restart_counts_without_restart_cnt_come_from_the_runs_place_in_a_D_listing(release, parser):
    """Issue 26 item 6: data_parser v0.0.40/v0.0.41 records have no ``restart_cnt`` (published
    README), so a record alone says nothing of the job's restarts. ``job_history`` always asks
    ``sacct -D`` (every run one record) and each run's count is its place among the job's runs,
    ordered by start (24.x keeps the submit time across a requeue), the never-started run last."""
    import json
    doc = json.loads(read(PUB / release / parser / "slurmrestd__slurmdb-job-failed.json"))
    (record,) = doc["jobs"]
    assert "restart_cnt" not in record
    t = record["time"]
    runs = []
    for index, state in enumerate(["REQUEUED", "REQUEUED", "FAILED"]):
        run = json.loads(json.dumps(record))
        run["state"]["current"] = [state]
        run["time"]["start"] = t["start"] + 100 * index
        run["time"]["end"] = t["end"] + 100 * index
        runs.append(run)
    doc["jobs"] = [runs[2], runs[0], runs[1]]  # accounting's order is not the runs' order
    jobs = parse_sacct(json.dumps(doc))
    assert [(j.state, j.restart_count) for j in jobs] == [
        (JobState.REQUEUED, 0), (JobState.REQUEUED, 1), (JobState.FAILED, 2)]
