"""JobEnv reads the job's environment once; Segment journals start/end and exits with the code."""

import pytest

from slurmft import exitcodes
from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.train.runtime import (JobEnv, JobEnvError, RunDirError, Segment,
                                   check_run_dir_writable, preflight)


def test_torchrun_variables_win_over_srun_ones():
    env = JobEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                               "LOCAL_WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                               "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "77",
                               "SLURM_RESTART_COUNT": "2", "SLURM_JOB_NUM_NODES": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.node) == (3, 4, 1, "n2")
    assert (env.job_id, env.restart_count, env.num_nodes) == ("77", 2, 2)
    assert not env.is_rank0 and not env.is_node_leader


def test_defaults_outside_slurm():
    env = JobEnv.from_environ({})
    assert (env.rank, env.world_size, env.job_id, env.restart_count) == (0, 1, None, 0)


@pytest.mark.parametrize("environ, needle", [
    ({"RANK": "x"}, "$RANK='x' is not an integer"),
    ({"WORLD_SIZE": "0"}, "$WORLD_SIZE=0 must be >= 1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is not below the world size 2"),
])
def test_bad_values_name_the_variable(environ, needle):
    with pytest.raises(JobEnvError, match=needle.replace("$", r"\$")):
        JobEnv.from_environ(environ)


def test_segment_journals_start_and_end_then_exits(tmp_path):
    env = JobEnv.from_environ({"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "1"})
    segment = Segment(env, RunDir(tmp_path))
    segment.started(restored_step=40)
    barrier_calls = []
    with pytest.raises(SystemExit) as exit_info:
        segment.end(exitcodes.REQUEUE, "preempted", step=41, barrier=lambda: barrier_calls.append(1))
    assert exit_info.value.code == exitcodes.REQUEUE and barrier_calls == [1]
    start, end = read_events(RunDir(tmp_path).events)
    assert (start.kind, start.get("restored_step"), start.get("job_id")) == ("segment_start", 40, "5")
    assert (end.kind, end.get("exit_code"), end.get("restart_count")) == ("segment_end", 85, 1)


def test_only_rank0_journals(tmp_path):
    env = JobEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2"})
    Segment(env, RunDir(tmp_path)).started(restored_step=None)
    assert not RunDir(tmp_path).events.exists()


def test_run_dir_checks(tmp_path):
    check_run_dir_writable(RunDir(tmp_path / "new"))
    assert (tmp_path / "new").is_dir() and list((tmp_path / "new").iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        check_run_dir_writable(RunDir(tmp_path / "file"))
    assert preflight(RunDir(tmp_path / "new"), min_free_gb=0) == []
    problems = preflight(RunDir(tmp_path / "new"), min_free_gb=1e9)
    assert len(problems) == 1 and problems[0].startswith("disk:")


def test_torchruns_restart_count_is_the_attempt_and_keys_every_event_of_the_segment(tmp_path):
    """In-allocation recovery restarts the workers inside one job segment: torchrun's
    TORCHELASTIC_RESTART_COUNT tells the attempts apart, on every event the ranks journal."""
    env = JobEnv.from_environ({"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "1",
                               "TORCHELASTIC_RESTART_COUNT": "2", "SLURMFT_JOB_ID": "4_1"})
    assert (env.attempt, env.slurm_id) == (2, "4_1")
    segment = Segment(env, RunDir(tmp_path))
    segment.started(restored_step=40)
    segment.record("loss", step=41, loss=0.5)
    with pytest.raises(SystemExit):
        segment.end(exitcodes.REFORM, "allocation generation moved", step=41)
    events = read_events(RunDir(tmp_path).events)
    assert [(e.kind, e.get("job_id"), e.get("restart_count"), e.get("attempt")) for e in events] == [
        ("segment_start", "5", 1, 2), ("loss", "5", 1, 2), ("segment_end", "5", 1, 2)]
    assert events[-1].get("outcome") == "REFORM (88)"


def test_no_torchrun_restart_count_is_attempt_zero_and_a_bad_one_is_named():
    env = JobEnv.from_environ({"SLURM_JOB_ID": "5"})
    assert (env.attempt, env.slurm_id) == (0, "5")
    with pytest.raises(JobEnvError, match=r"\$TORCHELASTIC_RESTART_COUNT=-1 must be >= 0"):
        JobEnv.from_environ({"TORCHELASTIC_RESTART_COUNT": "-1"})


def test_a_rank_other_than_0_journals_the_end_only_when_told(tmp_path):
    """Rank 0 may have died with its node: the allocation watch names the survivor that says
    how the segment ended; the others say nothing, rank 0 included when it is not that one."""
    for rank, here, written in ((1, True, True), (2, False, False), (0, False, False)):
        run = RunDir(tmp_path / f"r{rank}")
        env = JobEnv.from_environ({"RANK": str(rank), "WORLD_SIZE": "3", "SLURM_JOB_ID": "5"})
        Segment(env, run).finish(exitcodes.REFORM, "generation moved", step=7, journal_here=here)
        ends = read_events(run.events)
        assert [(e.get("exit_code"), e.get("rank")) for e in ends] == ([(88, rank)] if written else [])
