"""Restarts in place (torchrun's own, after a rank crash or a hang on a healthy node) as the
in-allocation launcher learns them from the journal, written here with the real writer the ranks
use (``slurmft.journal``), and the progress rule that ends a crash loop with 86."""

import pytest

from slurmft import exitcodes, journal
from slurmft.launch import inplace
from slurmft.launch.inplace import ProcessFaults
from slurmft.rundir import RunDir

pytestmark = pytest.mark.timeout(60)


def _put(run, kind, **fields):
    journal.append_event(run.events, kind, **{"job_id": "7", "restart_count": 2, **fields})


def _faults(tmp_path):
    run = RunDir(tmp_path)
    _put(run, journal.SEGMENT_START, restart_count=1, attempt=0)  # an earlier run's: before us
    return run, ProcessFaults(run.events, {"7"}, 2)


def test_a_restart_no_fence_explains_is_a_rank_crash_journaled_once(tmp_path):
    run, pf = _faults(tmp_path)
    _put(run, journal.SEGMENT_START, attempt=0)
    _put(run, journal.LOSS, step=3, loss=1.0)
    assert pf.poll() == ([], [])
    _put(run, journal.SEGMENT_START, attempt=1)
    found, restarts = pf.poll()
    assert [f.cause for f in found] == ["rank_crash"] and restarts == found
    assert "torchrun attempt 1" in found[0].evidence[0]
    assert found[0].fault_time == pytest.approx(
        [e.time for e in journal.read_events(run.events, [journal.LOSS])][0])
    assert pf.poll() == ([], [])


def test_a_hang_is_detected_when_journaled_and_its_restart_is_not_a_second_fault(tmp_path):
    run, pf = _faults(tmp_path)
    _put(run, journal.SEGMENT_START, attempt=0)
    _put(run, journal.HANG, rank=1, node="n2", message="step 4 has run 6 s")
    _put(run, journal.SEGMENT_END, exit_code=exitcodes.HANG)
    found, restarts = pf.poll()
    assert [(f.cause, f.nodes) for f in found] == [("hang", ["n2"])] and restarts == []
    assert "rank 1: step 4 has run 6 s" in found[0].evidence[0]
    _put(run, journal.SEGMENT_START, attempt=1)
    found, restarts = pf.poll()
    assert found == [] and [(r.cause, r.nodes) for r in restarts] == [("hang", ["n2"])]


@pytest.mark.parametrize("why", ["fence", "reform"])
def test_a_restart_the_launcher_caused_is_no_process_fault(tmp_path, why):
    run, pf = _faults(tmp_path)
    _put(run, journal.SEGMENT_START, attempt=0)
    if why == "fence":
        pf.fenced()
    else:
        _put(run, journal.SEGMENT_END, exit_code=exitcodes.REFORM)
    _put(run, journal.SEGMENT_START, attempt=1)
    assert pf.poll() == ([], [])
    _put(run, journal.SEGMENT_START, attempt=2)  # the next one is unexplained again
    assert [f.cause for f in pf.poll()[1]] == ["rank_crash"]


def test_another_job_or_restart_count_is_not_ours(tmp_path):
    run, pf = _faults(tmp_path)
    for fields in ({"job_id": "8"}, {"restart_count": 3}):
        _put(run, journal.SEGMENT_START, attempt=0, **fields)
        _put(run, journal.SEGMENT_START, attempt=1, **fields)
    assert pf.poll() == ([], [])


def test_restarts_in_a_row_count_only_while_no_newer_checkpoint_commits(tmp_path):
    run, pf = _faults(tmp_path)
    _put(run, journal.CHECKPOINT_COMMITTED, step=5)
    pf.poll()
    assert pf.count_restart() == 1
    assert pf.count_restart() == 2
    _put(run, journal.CHECKPOINT_COMMITTED, step=10)
    pf.poll()
    assert pf.count_restart() == 1  # progress since the last restart
    _put(run, journal.CHECKPOINT_COMMITTED, step=10)  # the same step again is no progress
    pf.poll()
    assert pf.count_restart() == 2


@pytest.mark.parametrize("code", [exitcodes.OK, exitcodes.REQUEUE, exitcodes.NO_REQUEUE])
def test_an_end_the_ranks_recorded_is_seen_and_a_hang_or_reform_is_none(tmp_path, code):
    run, pf = _faults(tmp_path)
    _put(run, journal.SEGMENT_START, attempt=0)
    for other in (exitcodes.HANG, exitcodes.REFORM):
        _put(run, journal.SEGMENT_END, exit_code=other)
    _put(run, journal.SEGMENT_END, exit_code=code, job_id="8")  # another job's
    pf.poll()
    assert pf.ended is None
    _put(run, journal.SEGMENT_END, exit_code=code)
    pf.poll()
    assert pf.ended == code


def _crash(run, node="n2", code=-9, how="killed by SIGKILL"):
    """What a node's warm server journals when a rank of its node crashed (``launch/rankexit``)."""
    _put(run, journal.RANK_EXIT, rank=1, node=node, exit_code=code, pid=4242, how=how, attempt=0)


def test_a_crash_its_warm_server_saw_is_detected_when_seen_and_its_restart_is_not_a_second_fault(
        tmp_path, monkeypatch):
    """Before: the crash was journaled only when the next world started (seconds to tens of
    seconds later). Now once its node beat again BEAT_AFTER_S after the rank_exit was read."""
    run = RunDir(tmp_path)
    _put(run, journal.SEGMENT_START, restart_count=1, attempt=0)
    beating: list[str] = []
    pf = ProcessFaults(run.events, {"7"}, 2, beat_within=lambda node, s: node in beating)
    _put(run, journal.SEGMENT_START, attempt=0)
    _put(run, journal.LOSS, step=3, loss=1.0)
    _crash(run)
    _crash(run, node="n1", code=1, how="exit code 1")  # a second rank's end: the same fault
    assert pf.poll() == ([], [])                       # read now: no beat since
    monkeypatch.setattr(inplace, "BEAT_AFTER_S", 0.0)
    assert pf.poll() == ([], [])                       # n2 has not beaten since: still waits
    beating.append("n2")
    found, restarts = pf.poll()
    assert [(f.cause, f.nodes) for f in found] == [("rank_crash", ["n2"])] and restarts == []
    assert "rank 1 on n2 ended: killed by SIGKILL (seen by its node's warm server)" in found[0].evidence[0]
    [exit_event] = [e for e in journal.read_events(run.events, [journal.RANK_EXIT]) if e.get("node") == "n2"]
    assert found[0].fault_time == pytest.approx(exit_event.time)
    assert pf.poll() == ([], [])
    _put(run, journal.SEGMENT_START, attempt=1)
    found, restarts = pf.poll()
    assert found == [] and [(r.cause, r.nodes) for r in restarts] == [("rank_crash", ["n2"])]
    _put(run, journal.SEGMENT_START, attempt=2)  # the next restart is a fault of its own again
    found, restarts = pf.poll()
    assert [f.nodes for f in found] == [[]] and restarts == found


def test_a_crash_whose_node_stopped_beating_or_that_a_fence_explains_is_not_a_process_fault(
        tmp_path, monkeypatch):
    """A node killed whole: its server may reap a rank a moment before it dies too. Its fence is
    the fault; the crash is dropped, and the fence's restart is no process fault either."""
    monkeypatch.setattr(inplace, "SETTLE_S", 0.0)
    monkeypatch.setattr(inplace, "BEAT_AFTER_S", 0.0)
    run, pf = _faults(tmp_path)  # nothing beats
    _put(run, journal.SEGMENT_START, attempt=0)
    _crash(run)
    assert pf.poll() == ([], [])
    pf.fenced()
    _put(run, journal.SEGMENT_START, attempt=1)
    assert pf.poll() == ([], [])
    pf2 = ProcessFaults(run.events, {"7"}, 2, beat_within=lambda node, s: True)
    _crash(run)
    pf2.fenced()                # fenced before the settle: dropped although its node beats
    assert pf2.poll() == ([], [])


def test_the_newest_commit_reads_the_journal_up_to_now(tmp_path):
    """An admin's drain is judged against the newest checkpoint at its first sight: a commit
    journaled since the last poll() must count, or a checkpoint from before the drain passes for
    one after it and the node is fenced at once (seen under load in test_inalloc_nodestate)."""
    run, pf = _faults(tmp_path)
    _put(run, journal.SEGMENT_START, attempt=0)
    _put(run, journal.CHECKPOINT_COMMITTED, step=10)
    pf.poll()
    _put(run, journal.CHECKPOINT_COMMITTED, step=15)  # no poll() since
    assert pf.newest_commit == 15
