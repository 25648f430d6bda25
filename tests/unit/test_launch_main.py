"""The launcher's order of work over a recorded job environment, with a stand-in ``srun`` on
the PATH (a script that prints the pre-flight lines it is given and plays the training step by
journaling the segment's outcome): exclusions, requeue requests without scontrol, and the exit
decided by THIS segment's recorded outcome, never by a DONE file left by an earlier run."""

import os
import signal
import sys
import textwrap

import pytest

from launch_envs import recorded
from slurmft import exitcodes, journal
from slurmft.journal import read_events
from slurmft.launch.main import launch
from slurmft.rundir import RunDir, write_done

pytestmark = pytest.mark.timeout(60)

FAKE_SRUN = textwrap.dedent(f"""\
    #!{sys.executable}
    import os, sys
    from slurmft import journal
    if "slurmft.launch.nodecheck" in sys.argv:
        if os.environ.get("FAKE_POLL_OUT"):
            with open(os.environ["FAKE_POLL_OUT"] + ".preflight", "w") as out:
                out.write(os.environ.get("SLURMFT_RDZV_POLL_S", "unset"))
        print(os.environ["FAKE_PREFLIGHT"].replace(";", "\\n"))
        sys.exit(0)
    if os.environ.get("FAKE_ENV_OUT") and os.environ.get("SLURMFT_ALIVE_FILE"):  # a node's step
        node = os.path.basename(os.environ["SLURMFT_ALIVE_FILE"])
        with open(os.path.join(os.environ["FAKE_ENV_OUT"], node), "w") as out:
            out.write(os.environ.get("SLURMFT_NODE_SILENT_S", "unset"))
    if os.environ.get("FAKE_POLL_OUT") and "slurmft.launch.task" in sys.argv:  # the training step
        with open(os.environ["FAKE_POLL_OUT"], "w") as out:
            out.write(os.environ.get("SLURMFT_RDZV_POLL_S", "unset"))
    code = int(os.environ["FAKE_CODE"])
    journal.append_event(os.path.join(os.environ["SLURMFT_RUN_DIR"], "events.jsonl"),
                         journal.SEGMENT_END, job_id=os.environ["SLURM_JOB_ID"],
                         restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                         exit_code=code)
    sys.exit(1 if code else 0)
    """)
GOOD = "PORT n1 40001;DONE n1;DONE n2"


@pytest.fixture(autouse=True)
def _keep_signal_handlers():
    """launch() installs its USR2/TERM handlers; give pytest its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _launch(tmp_path, preflight=GOOD, code=0, path=None, env_name="nonarray", extra=None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text("")
    env = {**recorded(env_name), "SLURMFT_RUN_DIR": str(tmp_path / "run"),
           "PATH": str(bin_dir) if path is None else path, "FAKE_PREFLIGHT": preflight,
           "FAKE_CODE": str(code), "PYTHONPATH": os.pathsep.join(sys.path), **(extra or {})}
    return launch([str(script)], env)


def _events(tmp_path, kind):
    return read_events(RunDir(tmp_path / "run").events, [kind])


def test_a_node_that_failed_a_check_is_excluded_and_without_scontrol_the_watcher_is_asked(tmp_path):
    rc = _launch(tmp_path, "PORT n1 1;DONE n1;FAIL n2 disk: 0.1 GiB free;DONE n2")
    assert rc == exitcodes.REQUEUE
    [request] = _events(tmp_path, journal.REQUEUE_REQUEST)
    assert request.get("exclude") == ["n2"]
    [exclusion] = [e for e in _events(tmp_path, journal.TEMPLATE) if e.get("action") == "exclude"]
    assert (exclusion.get("node"), exclusion.get("evidence")) == ("n2", "disk: 0.1 GiB free")


def test_a_busy_sweep_alone_excludes_nothing(tmp_path):
    rc = _launch(tmp_path, "PORT n1 1;SKIP n1 sweep: busy;DONE n1;SKIP n2 sweep: busy;DONE n2")
    assert rc == exitcodes.OK and _events(tmp_path, journal.REQUEUE_REQUEST) == []


def test_a_stale_done_does_not_end_a_run_that_was_preempted(tmp_path):
    write_done(RunDir(tmp_path / "run"), job_id="7", step=40, total_steps=40)  # an earlier run's
    rc = _launch(tmp_path, code=exitcodes.REQUEUE)
    assert rc == exitcodes.REQUEUE
    assert "no scontrol" in _events(tmp_path, journal.REQUEUE_REQUEST)[0].get("reason")


@pytest.mark.parametrize("code, expected", [(0, 0), (exitcodes.NO_REQUEUE, exitcodes.NO_REQUEUE),
                                            (exitcodes.HANG, exitcodes.HANG)])
def test_the_recorded_outcome_decides(tmp_path, code, expected):
    assert _launch(tmp_path, code=code) == expected


def test_no_answer_from_any_node_requeues_without_excluding(tmp_path):
    assert _launch(tmp_path, "srun: error: Unable to create step") == exitcodes.REQUEUE
    assert _events(tmp_path, journal.REQUEUE_REQUEST)[0].get("exclude") == []


def test_missing_srun_is_a_failure_never_do_not_requeue(tmp_path):
    assert _launch(tmp_path, path=str(tmp_path / "empty")) == 1


def test_a_job_check_failing_on_every_node_exits_do_not_requeue_excluding_nothing(tmp_path):
    rc = _launch(tmp_path, "FAIL n1 run-dir: /runs/x not writable;DONE n1;"
                           "FAIL n2 run-dir: /runs/x not writable;DONE n2")
    assert rc == exitcodes.NO_REQUEUE
    assert _events(tmp_path, journal.REQUEUE_REQUEST) == []
    [why] = [e for e in _events(tmp_path, journal.TEMPLATE) if e.get("action") == "give_up"]
    assert "run-dir check failed on every node" in why.get("reason")


def test_an_array_task_whose_run_dir_a_sibling_task_holds_is_refused_with_one_line(tmp_path, capfd):
    from slurmft.launch import identity
    from slurmft.launch.claim import claim_run_dir

    (tmp_path / "run").mkdir()
    claim_run_dir(tmp_path / "run", identity.from_environ(recorded("array-task0")), None)
    assert _launch(tmp_path, env_name="array-task1") == exitcodes.NO_REQUEUE
    lines = [line for line in capfd.readouterr().err.splitlines() if "ERROR" in line]
    assert len(lines) == 1 and "claimed by job 2_0 (task 0 of array job 2)" in lines[0]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["claim.json"]  # nothing written


def test_an_array_task_in_its_own_run_dir_runs(tmp_path):
    assert _launch(tmp_path, "PORT n2 40001;DONE n2", env_name="array-task1") == exitcodes.OK


@pytest.mark.parametrize("extra, named", [
    ({"SLURMFT_SPARE_NODES": "2"}, "SLURMFT_SPARE_NODES='2' must be between 0 and 1"),
    ({"SLURMFT_IN_ALLOCATION": "1", "SLURMFT_MIN_NODES": "3"}, "SLURMFT_MIN_NODES='3'"),
])
def test_a_bad_in_allocation_setting_gives_up_before_anything_starts(tmp_path, capfd, extra, named):
    assert _launch(tmp_path, extra=extra) == exitcodes.NO_REQUEUE
    lines = [line for line in capfd.readouterr().err.splitlines() if "ERROR" in line]
    assert len(lines) == 1 and named in lines[0]
    assert not (tmp_path / "run" / "allocation.json").exists()
    assert [e.get("action") for e in _events(tmp_path, journal.TEMPLATE)] == ["give_up"]


@pytest.mark.parametrize("extra, bound", [({}, "5"), ({"SLURMFT_NODE_SILENT_S": "7.5"}, "7.5")])
def test_every_node_step_gets_the_silence_bound_the_launcher_judges_by(tmp_path, extra, bound):
    """The ranks wait on a re-forming for this bound (``alloc_watch``): the launcher's own value,
    its default included, never a default spelled again on the ranks' side."""
    out = tmp_path / "env-out"
    out.mkdir()
    extra = {"SLURMFT_IN_ALLOCATION": "1", "FAKE_ENV_OUT": str(out), **extra}
    assert _launch(tmp_path, extra=extra) == exitcodes.OK
    assert {p.name: p.read_text() for p in out.iterdir()} == {"n1.json": bound, "n2.json": bound}


def test_the_requeue_paths_training_step_gets_the_rendezvous_poll(tmp_path):
    """Each start of a requeued job forms a first rendezvous round: its agents poll it every
    ``rdzv_poll.poll_for(nodes)`` (0.1 s for 2 nodes), whatever the launcher's own environment
    said; the pre-flight's step (not torchrun's) keeps the launcher's environment as it was."""
    out = tmp_path / "poll"
    assert _launch(tmp_path, extra={"FAKE_POLL_OUT": str(out), "SLURMFT_RDZV_POLL_S": "0.9"}) == exitcodes.OK
    assert out.read_text() == "0.1"
    assert (tmp_path / "poll.preflight").read_text() == "0.9"
