"""Pre-flight verdicts: only a check that ran and failed, or a node that did not answer,
excludes a node; a busy sweep is waited for (bounded) or its fresh report used."""

import json
import os
import random
import socket
import time

import pytest

from launch_envs import recorded
from slurmft.launch import identity, nodecheck, preflight, settings

pytestmark = pytest.mark.timeout(30)
NODES = ("n1", "n2", "n3")


def test_answers_and_failures_become_exclusions_with_evidence():
    out = "\n".join([
        "PORT n1 40001", "NOTE n1 sweep: waited 3.0 s", "DONE n1",
        "FAIL n2 disk: /runs has 0.1 GiB free, below 1 GiB", "SKIP n2 sweep: busy", "DONE n2",
        "srun: error: n3: task 2: Exited with exit code 1",        # srun's own lines: ignored
    ])
    result = preflight.parse(out, NODES, rc=1)
    assert result.ran and result.ports == {"n1": 40001}
    assert result.exclusions() == {"n2": "disk: /runs has 0.1 GiB free, below 1 GiB",
                                   "n3": "pre-flight task ended without a verdict (srun exit 1)"}
    assert result.skipped == {"n2": ["sweep: busy"]}
    assert result.notes == {"n1": ["sweep: waited 3.0 s"]} and "n1" not in result.exclusions()


def test_a_silent_node_after_the_bound_is_excluded_as_not_answering():
    result = preflight.parse("DONE n1\nDONE n2\n", NODES, rc=None)
    assert result.exclusions() == {"n3": "did not answer the pre-flight within its time"}


def test_a_skipped_check_alone_excludes_nothing():
    out = "".join(f"SKIP {n} sweep: another sweep held this node's lock\nDONE {n}\n" for n in NODES)
    assert preflight.parse(out, NODES, rc=0).exclusions() == {}


def test_no_answer_at_all_means_the_preflight_did_not_run_and_excludes_nobody():
    result = preflight.parse("srun: error: Unable to create step for job 7: Job credential revoked", NODES, rc=1)
    assert not result.ran and result.exclusions() == {}


def test_lines_naming_other_nodes_are_ignored():
    result = preflight.parse("FAIL n9 disk: x\nDONE n1\n", ("n1",), rc=0)
    assert result.exclusions() == {} and result.failures == {}


def test_srun_argv_is_bounded_and_one_task_per_node():
    env = {**recorded("nonarray"), "SLURMFT_RUN_DIR": "/runs/a", "SLURMFT_PREFLIGHT_TIMEOUT_S": "60"}
    ident = identity.from_environ(env)
    argv = preflight.srun_argv(ident, settings.from_environ(env, ident), "/py")
    assert argv[:4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    assert argv[argv.index("--deadline-s") + 1] == "55.0"  # the node reports before srun's bound


class Sweeps:
    """Stands in for the sweep subprocess: a list of (rc, stdout) answers, in order."""

    def __init__(self, answers):
        self.answers, self.calls = list(answers), 0

    def __call__(self, argv, timeout):
        assert "--dry-run" in argv and timeout > 0
        self.calls += 1
        rc, out = self.answers.pop(0) if self.answers else (3, "")
        return rc, out, ""


def _report(*statuses):
    return json.dumps({"node": "n1", "results": [
        {"check": f"c{i}", "status": s, "detail": f"detail {i}"} for i, s in enumerate(statuses)]})


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def _lines(answers, wait_s=10.0, deadline=100.0, monkeypatch=None, report=None):
    clock = Clock()
    if monkeypatch is not None:
        monkeypatch.setattr(nodecheck, "fresh_report", lambda node, fresh_s: report)
    sweeps = Sweeps(answers)
    lines = nodecheck.sweep_lines("n1", "/py", deadline, wait_s, 300, run=sweeps, sleep=clock.sleep,
                                  clock=clock)
    return lines, sweeps, clock


def test_sweep_that_ran_reports_only_its_failed_checks(monkeypatch):
    lines, _, _ = _lines([(1, _report("ok", "fail", "skipped"))], monkeypatch=monkeypatch)
    assert lines == ["FAIL n1 sweep: c1: detail 1"]


def test_busy_sweep_is_retried_until_it_runs(monkeypatch):
    lines, sweeps, clock = _lines([(3, ""), (3, ""), (0, _report("ok"))], monkeypatch=monkeypatch)
    assert sweeps.calls == 3 and clock.now >= 2 * 0.5  # the retry floor
    # judged (no FAIL, no SKIP), with a note that says the lock was contended
    assert len(lines) == 1 and lines[0].startswith("NOTE n1 sweep: another sweep held this node's lock; waited")


def test_busy_sweep_past_its_wait_is_not_judged_never_failed(monkeypatch):
    lines, sweeps, clock = _lines([], wait_s=5.0, monkeypatch=monkeypatch)
    assert len(lines) == 1 and lines[0].startswith("SKIP n1 sweep: another sweep held")
    assert clock.now <= 5.0 and sweeps.calls <= 6


def test_busy_sweep_uses_a_fresh_report(monkeypatch):
    lines, sweeps, _ = _lines([(3, "")], monkeypatch=monkeypatch, report=json.loads(_report("fail")))
    assert lines[0] == "FAIL n1 sweep: c0: detail 0" and sweeps.calls == 1
    assert lines[1] == "NOTE n1 sweep: busy; judged by its report from the last sweep"


def test_sweep_without_a_report_is_skipped(monkeypatch):
    lines, _, _ = _lines([(4, "Traceback ...")], monkeypatch=monkeypatch)
    assert lines[0].startswith("SKIP n1 sweep: no report (exit 4")


def test_fresh_report_reads_only_a_recent_regular_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMFT_SWEEP_REPORT_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "n1.json").write_text(_report("fail"))
    assert nodecheck.fresh_report("n1", 300)["node"] == "n1"
    assert nodecheck.fresh_report("n1", 300, now=time.time() + 301) is None   # stale
    assert nodecheck.fresh_report("n2", 300) is None                          # none
    os.symlink(tmp_path / "n1.json", tmp_path / "n3.json")
    assert nodecheck.fresh_report("n3", 300) is None                          # a link: not followed


def test_check_node_fails_a_hung_check_and_forwards_failures(tmp_path, monkeypatch):
    monkeypatch.setattr(nodecheck, "sweep_lines", lambda *a, **k: [])

    def hung(argv, timeout):
        return None, "", ""

    lines = nodecheck.check_node("n1", tmp_path, 1.0, 5.0, 1.0, 300, run=hung)
    assert lines[0].startswith("PORT n1 ") and lines[1].startswith("FAIL n1 hung: the run-dir/disk/torch check did not finish")

    def failed(argv, timeout):
        return 1, "FAIL n1 disk: full\n", ""

    assert nodecheck.check_node("n1", tmp_path, 1.0, 5.0, 1.0, 300, run=failed)[1:] == ["FAIL n1 disk: full"]


# -- a failure of the job's own environment is the job's problem (issue 25) -------------------

def test_the_same_job_check_failing_on_every_node_is_the_jobs_problem():
    out = "\n".join(f"FAIL {n} python: cannot import torch: ModuleNotFoundError\nDONE {n}" for n in NODES)
    line = preflight.jobs_own_failure(preflight.parse(out, NODES, rc=0), NODES, {})
    assert line is not None and "python check failed on every node" in line
    # Every node failing, but the sweep's checks (the nodes' own health): the nodes are to blame.
    sweep = "\n".join(f"FAIL {n} sweep: gpu: xid 79\nDONE {n}" for n in NODES)
    assert preflight.jobs_own_failure(preflight.parse(sweep, NODES, rc=0), NODES, {}) is None
    # One node of three: that node.
    one = "FAIL n2 python: cannot import torch\nDONE n1\nDONE n2\nDONE n3"
    assert preflight.jobs_own_failure(preflight.parse(one, NODES, rc=0), NODES, {}) is None


def test_a_one_node_job_failing_the_same_job_check_on_a_second_node_is_the_jobs_problem(tmp_path):
    """torch missing from the job's venv: the first try excludes n1 (a node can have a broken
    install); the second, on n2, fails the same way: no third healthy node is excluded."""
    from slurmft import journal

    ident = identity.from_environ({**recorded("nonarray"), "SLURM_JOB_NODELIST": "n2",
                                   "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODELIST": "n2",
                                   "SLURM_RESTART_COUNT": "1"})
    run = tmp_path / "run"
    journal.append_event(run / "events.jsonl", journal.TEMPLATE, job_id="1", restart_count=0,
                         action="exclude", node="n1", evidence="python: cannot import torch: x")
    journal.append_event(run / "events.jsonl", journal.TEMPLATE, job_id="99", restart_count=0,
                         action="exclude", node="n3", evidence="disk: 0 GiB free")  # another job
    earlier = preflight.earlier_failures(run, ident)
    assert earlier == {"n1": {"python"}}
    torch = preflight.parse("FAIL n2 python: cannot import torch: x\nDONE n2", ("n2",), rc=0)
    line = preflight.jobs_own_failure(torch, ("n2",), earlier)
    assert line is not None and "on n2" in line and "as it did on n1" in line
    disk = preflight.parse("FAIL n2 disk: 0 GiB free\nDONE n2", ("n2",), rc=0)
    assert preflight.jobs_own_failure(disk, ("n2",), earlier) is None  # another check: n2's own
    assert preflight.earlier_failures(tmp_path / "absent", ident) == {}


def test_the_rendezvous_port_is_free_and_below_the_ephemeral_range():
    """A port from the ephemeral range (what binding port 0 gives) can be taken by any outbound
    connection between the pre-flight and torchrun's bind: the store failed with EADDRINUSE so."""
    low = nodecheck.ephemeral_low()
    for seed in range(20):
        port = nodecheck.free_port(random.Random(seed))
        assert nodecheck.LISTEN_LOW <= port < low
        with socket.socket() as sock:
            sock.bind(("", port))  # free: it can be listened on


def test_a_taken_port_is_not_offered(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        monkeypatch.setattr(nodecheck, "LISTEN_LOW", busy)
        monkeypatch.setattr(nodecheck, "ephemeral_low", lambda: busy + 2)  # candidates: busy, busy + 1
        for seed in range(10):
            assert nodecheck.free_port(random.Random(seed)) != busy
