"""What CliSlurmClient runs, per release, replayed from captured real output (no controller here:
the live behaviour is covered by tests/integration/test_slurm_client.py on every release)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import InvalidArgument, JobNotFound, JobState, SlurmError
from slurmft.slurm.config import SlurmConfig
from slurmft.slurm.runner import Result

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
LIST_2411 = "Possible data_parser plugins:\ndata_parser/v0.0.42\ndata_parser/v0.0.40\ndata_parser/v0.0.41\n"


class Replay:
    """Answers each argv with recorded output; records every argv it was asked to run."""

    def __init__(self, answers):
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    def run(self, argv, **kwargs):
        argv = tuple(argv)
        self.calls.append(argv)
        self.kwargs = kwargs
        answer = self.answers(argv) if callable(self.answers) else self.answers[argv]
        if isinstance(answer, Exception):
            raise answer
        return Result(argv, 0, answer, "")


def client(version: str, answers, **config) -> tuple[CliSlurmClient, Replay]:
    def answer(argv):
        if argv == ("sinfo", "--version"):
            return f"slurm-wlm {version}\n"
        if argv == ("scontrol", "--json=list"):
            return LIST_2411
        return answers(argv)
    replay = Replay(answer)
    return CliSlurmClient(SlurmConfig(**config), runner=replay), replay


def test_2411_picks_newest_parser_and_filters_in_one_call():
    job_json = (FIX / "published/24.11/v0.0.42/slurmrestd__slurm-job-running.json").read_text()
    c, replay = client("24.11.5", lambda argv: job_json)
    assert c.info().data_parser == "v0.0.42"
    jobs = c.jobs(["6368", "6369"])
    assert set(jobs) == {"6368"} and jobs["6368"].state is JobState.RUNNING
    assert replay.calls[-1] == ("squeue", "--json=v0.0.42", "-t", "all", "-j", "6368,6369")


def test_2411_unknown_id_in_filter_falls_back_to_unfiltered_query():
    job_json = (FIX / "published/24.11/v0.0.42/slurmrestd__slurm-job-running.json").read_text()

    def answer(argv):
        if "-j" in argv:
            return JobNotFound("squeue: slurm_load_jobs error: Invalid job id specified")
        return job_json
    c, replay = client("24.11.5", answer)
    assert set(c.jobs(["6368", "424242"])) == {"6368"}
    assert replay.calls[-1] == ("squeue", "--json=v0.0.42", "-t", "all")


def test_2205_has_no_pins_and_queries_unfiltered():
    text = (FIX / "2205/squeue_running_failed_completed.json").read_text()
    c, replay = client("22.05.8", lambda argv: text)
    assert c.info().data_parser is None
    c.jobs(["1"])
    assert replay.calls[-1] == ("squeue", "--json")
    assert ("scontrol", "--json=list") not in replay.calls


def test_pins_checked_against_the_release():
    c, _ = client("24.11.5", lambda argv: "", data_parser="v0.0.41")
    assert c.info().data_parser == "v0.0.41"
    c, _ = client("24.11.5", lambda argv: "", data_parser="v0.0.44")
    with pytest.raises(InvalidArgument, match="v0.0.44.*offers v0.0.40, v0.0.41, v0.0.42"):
        c.info()
    c, _ = client("22.05.8", lambda argv: "", data_parser="v0.0.42")
    with pytest.raises(InvalidArgument, match="no data_parser pins"):
        c.info()


def test_nodes_and_history_commands_per_release():
    nodes_json = (FIX / "published/24.11/v0.0.42/slurmrestd__slurm-node-drain.json").read_text()
    sacct_json = (FIX / "published/24.11/v0.0.42/slurmrestd__slurmdb-job-failed.json").read_text()
    c, replay = client("24.11.5", lambda argv: nodes_json if argv[0] == "scontrol" else sacct_json)
    assert c.nodes(["cn4"])["cn4"].drained
    assert replay.calls[-1] == ("scontrol", "--json=v0.0.42", "show", "nodes")
    assert c.job_history("6359")[0].exit_code == 1
    assert replay.calls[-1] == ("sacct", "--json=v0.0.42", "-D", "-j", "6359")

    sinfo = (FIX / "2205/sinfo_drain_down.json").read_text()
    sacct_text = (FIX / "2205/sacct_text_history.txt").read_text()
    c, replay = client("22.05.8", lambda argv: sinfo if argv[0] == "sinfo" else sacct_text)
    assert c.nodes(["n4"])["n4"].down and replay.calls[-1] == ("sinfo", "--json")
    assert [j.exit_code for j in c.job_history("2")] == [3]
    assert replay.calls[-1][:6] == ("sacct", "-P", "--noheader", "-D", "-X", "-j")


def test_a_failed_prolog_on_a_second_node_is_found_from_accounting_and_the_node_table():
    # 22.05.8, captured: a 2-node job whose prolog failed on n2 (Slurm drained n2 "Prolog error",
    # the batch step ran on n1): the node to exclude is n2, never the batch host n1.
    steps = (FIX / "2205/sacct_steps_prolog_failed_second_node.txt").read_text()
    sinfo = (FIX / "2205/sinfo_prolog_error_drain.json").read_text()
    held = (FIX / "2205/squeue_held_prolog_failed.json").read_text()
    c, replay = client("22.05.8", lambda argv: {"sacct": steps, "sinfo": sinfo}.get(argv[0], held))
    job = c.jobs(["2"])["2"]
    assert c.failed_launch_nodes(job) == (("n2",), "Slurm drained it: Prolog error")
    assert replay.calls[-2] == ("sacct", "-P", "--noheader", "-D", "-j", "2", "-o",
                                "JobIDRaw,State,NodeList")
    assert replay.calls[-1] == ("sinfo", "--json")


def test_update_pending_merges_exclusions_and_starts_now():
    pending = (FIX / "published/24.11/v0.0.42/slurmrestd__slurm-job-pending.json").read_text()
    c, replay = client("24.11.5", lambda argv: pending if argv[0] == "squeue" else "")
    c.update_pending("6370", exclude_nodes=["cn2", "cn1"], start_now=True)
    assert replay.calls[-1] == ("scontrol", "update", "JobId=6370", "ExcNodeList=cn[1-2]", "StartTime=now")


def test_update_pending_takes_a_job_requeued_while_its_batch_script_ends_on_2205():
    """Right after the launcher's own ``scontrol requeue`` (the launcher is the batch script),
    22.05 prints the job as COMPLETING: the exclusion is sent (Slurm takes it), where it used
    to be refused here as 'RUNNING, not PENDING' and only the watcher could exclude the node.
    A job that is just RUNNING is still refused without asking Slurm."""
    completing = (FIX / "2205/squeue_requeued_completing.json").read_text()
    c, replay = client("22.05.8", lambda argv: completing if argv[0] == "squeue" else "")
    job = c.job("1")
    assert job.state is JobState.RUNNING and job.completing and job.restart_count == 1
    c.update_pending("1", exclude_nodes=["n2"])
    assert replay.calls[-1] == ("scontrol", "update", "JobId=1", "ExcNodeList=n2")

    running = (FIX / "2205/squeue_running_failed_completed.json").read_text()
    c, replay = client("22.05.8", lambda argv: running if argv[0] == "squeue" else "")
    with pytest.raises(SlurmError, match="job 1 is RUNNING, not PENDING"):
        c.update_pending("1", exclude_nodes=["n2"])
    assert not any(call[:2] == ("scontrol", "update") for call in replay.calls)


def test_submit_options_validated_and_id_parsed(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    c, replay = client("22.05.8", lambda argv: "77;cluster\n")
    assert c.submit(script, ["--steps", "5"], sbatch_options=["-N2"]) == "77"
    assert replay.calls[-1] == ("sbatch", "--parsable", "-N2", str(script), "--steps", "5")
    with pytest.raises(InvalidArgument, match="must start with '-'"):
        c.submit(script, sbatch_options=["N2"])
    with pytest.raises(InvalidArgument, match="does not exist"):
        c.submit(tmp_path / "missing.sh")


def test_a_drain_that_got_no_answer_is_read_back_not_sent_again():
    from slurmft.slurm.client import OutcomeUnknown

    sinfo = (FIX / "2205/sinfo_drain_down.json").read_text()  # n3 drained with this reason

    def answer(argv):
        if argv[:2] == ("scontrol", "update"):
            return OutcomeUnknown("scontrol update: Socket timed out on send/recv operation")
        return sinfo
    c, replay = client("22.05.8", answer)
    c.drain("n3", "slurmft: gpu: xid 79 (fallen off the bus)")
    updates = [call for call in replay.calls if call[:2] == ("scontrol", "update")]
    assert updates == [("scontrol", "update", "NodeName=n3", "State=DRAIN",
                        "Reason=slurmft: gpu: xid 79 (fallen off the bus)")]
    with pytest.raises(OutcomeUnknown):  # n2 is not drained: sent twice, then the error stands
        c.drain("n2", "slurmft: node_disk: full")
    assert [call[2] for call in replay.calls if call[:2] == ("scontrol", "update")] == [
        "NodeName=n3", "NodeName=n2", "NodeName=n2"]


def test_set_down_that_got_no_answer_is_read_back():
    from slurmft.slurm.client import OutcomeUnknown

    sinfo = (FIX / "2205/sinfo_drain_down.json").read_text()  # n4 is DOWN

    def answer(argv):
        if argv[:2] == ("scontrol", "update"):
            return OutcomeUnknown("scontrol update: no answer within 20 s")
        return sinfo
    c, replay = client("22.05.8", answer)
    c.set_down("n4", "slurmft: watch: silent")
    assert [call[2] for call in replay.calls if call[:2] == ("scontrol", "update")] == ["NodeName=n4"]


def test_2205_accounting_finds_an_array_task_by_its_task_id():
    """22.05's sacct text names an array task by its raw id alone (JobIDRaw 1 for task 1_1): the
    task Slurm's ``-j 1_1`` returned is that task. Once lost, a watcher restarted for a forgotten
    array task said 'job 1_1 does not exist'."""
    text = (FIX / "2205/sacct_text_array_task.txt").read_text()
    c, replay = client("22.05.8", lambda argv: text if argv[0] == "sacct" else "")
    [task] = c.job_history("1_1")
    assert (task.job_id, task.raw_job_id, task.state, task.exit_code) == ("1_1", "1", JobState.FAILED, 1)
    assert replay.calls[-1][5:7] == ("-j", "1_1")


def test_signal_step_kills_one_step_of_the_job_once():
    c, replay = client("22.05.8", lambda argv: "")
    c.signal_step("104_3", "7")
    assert replay.calls == [("scancel", "--signal=KILL", "104_3.7")]


@pytest.mark.parametrize("job, step", [("104", "7;x"), ("104", "-1"), ("104", ""), ("1.2", "3"),
                                       ("104", True)])
def test_signal_step_refuses_what_is_not_a_step(job, step):
    c, replay = client("22.05.8", lambda argv: "")
    with pytest.raises(InvalidArgument):
        c.signal_step(job, step)
    assert replay.calls == []


def test_release_nodes_keeps_the_rest_of_a_running_job_and_refuses_an_ending_one():
    """In-allocation mode's requeue hands a dead node back first (launch/handback.py): the
    running job keeps its other nodes; nothing is sent for a node not in it, a bad name or a job
    Slurm is already ending (the COMPLETING one right after a requeue, captured on 22.05)."""
    running = (FIX / "2205/squeue_running_failed_completed.json").read_text()
    c, replay = client("22.05.8", lambda argv: running if argv[0] == "squeue" else "")
    c.release_nodes("1", ["n2"])
    assert replay.calls[-1] == ("scontrol", "update", "JobId=1", "NodeList=n1")
    # in a scratch directory, gone after: scontrol writes the job's resize scripts into its cwd
    scratch = replay.kwargs.get("cwd")
    assert scratch and "slurmft-resize-" in scratch and not Path(scratch).exists()
    sent = len(replay.calls)
    c.release_nodes("1", ["n7"])  # not the job's: nothing to do
    with pytest.raises(SlurmError, match="would leave it no node"):
        c.release_nodes("1", ["n1", "n2"])
    with pytest.raises(InvalidArgument):
        c.release_nodes("1", ["n2;reboot"])
    assert not any(call[:2] == ("scontrol", "update") for call in replay.calls[sent:])

    completing = (FIX / "2205/squeue_requeued_completing.json").read_text()
    c, replay = client("22.05.8", lambda argv: completing if argv[0] == "squeue" else "")
    with pytest.raises(SlurmError, match="not RUNNING: no node released"):
        c.release_nodes("1", ["n2"])
    assert not any(call[:2] == ("scontrol", "update") for call in replay.calls)
