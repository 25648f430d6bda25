"""launch/handback.py: before a requeue from the allocation, a dead node is released from the job
once Slurm flags it, and only then (the live requeue is tests/integration/test_inalloc_requeue.py).

Slurm's node states are captured 22.05 ``sinfo --json`` output (tests/fixtures/slurm/README.md
names the source) through the real parser; only the controller calls are stood in for."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from slurmft.launch import handback
from slurmft.slurm.client import OutcomeUnknown, SlurmError, SlurmUnavailable
from slurmft.slurm.parse_nodes import parse_nodes

CAPTURED = parse_nodes((Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "2205" /
                        "sinfo_drain_down.json").read_text(), "sinfo --json")
UP, DRAINED, DEAD = CAPTURED["n1"], CAPTURED["n3"], CAPTURED["n4"]  # n4: DOWN, NOT_RESPONDING


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Slurm:
    """Answers ``nodes`` with ``states(name, poll)``; records every release."""

    def __init__(self, states, release_error: Exception | None = None) -> None:
        self.states, self.release_error = states, release_error
        self.polls = 0
        self.released: list[tuple[str, list[str]]] = []
        self.signalled: list[tuple[str, str, str]] = []

    def nodes(self, names):
        self.polls += 1
        answer = {}
        for name in names:
            node = self.states(name, self.polls)
            if isinstance(node, Exception):
                raise node
            answer[name] = dataclasses.replace(node, name=name)
        return answer

    def release_nodes(self, job_id, nodes):
        if self.release_error is not None:
            raise self.release_error
        self.released.append((job_id, list(nodes)))


def _release(slurm, nodes, reached=lambda n: handback.FAILED, **kw):
    clock, lines = Clock(), []
    got = handback.release_lost(slurm, "7", nodes, reached, lines.append, clock=clock,
                                sleep=clock.sleep, **kw)
    return got, lines, clock


def test_a_dead_node_is_released_only_once_slurm_flags_it():
    # Slurm still shows n3 up for three polls (its slurmd not asked yet), then NOT_RESPONDING.
    slurm = Slurm(lambda name, poll: UP if poll <= 3 else DEAD)
    got, lines, clock = _release(slurm, ["n3"])
    assert got == ["n3"] and slurm.released == [("7", ["n3"])]
    assert slurm.polls == 4 and clock.now == 3 * handback.POLL_S
    assert "released n3 from the job" in lines[-1] and "NOT_RESPONDING" in lines[-1]


def test_a_drained_node_counts_as_flagged_and_each_node_is_judged_alone():
    states = {"n3": DRAINED, "n5": DEAD, "n6": UP}
    slurm = Slurm(lambda name, poll: states[name])
    got, lines, clock = _release(slurm, ["n3", "n5", "n6"], wait_s=5.0)
    # n6 never flagged: waited the bound, then the flagged ones released and n6 left in the job
    assert got == ["n3", "n5"] and slurm.released == [("7", ["n3", "n5"])]
    assert clock.now >= 5.0
    assert any("n6 not flagged by Slurm after 5 s" in line for line in lines)


def test_a_node_whose_step_slurm_could_signal_is_left_alone():
    slurm = Slurm(lambda name, poll: DEAD)
    got, lines, _ = _release(slurm, ["n3"], reached=lambda n: handback.DELIVERED)
    assert got == [] and slurm.polls == 0 and slurm.released == [] and lines == []


def test_a_node_whose_step_ended_by_itself_is_not_waited_for():
    """No KILL was sent (its step had ended: a task killed on a node whose slurmd may well be
    alive): one look, released only when Slurm flags it already, never the wait."""
    kinds = {"n3": UP, "n5": DEAD}
    slurm = Slurm(lambda name, poll: kinds[name])
    got, lines, clock = _release(slurm, ["n3", "n5"], reached=lambda n: handback.UNSENT)
    assert got == ["n5"] and slurm.released == [("7", ["n5"])] and slurm.polls == 1
    assert clock.now == 0.0
    # a KILL Slurm refused (the step already gone) is no evidence either
    refused = Slurm(lambda name, poll: kinds[name])
    assert _release(refused, ["n3"], reached=lambda n: handback.REFUSED)[0] == [] and refused.polls == 1
    assert lines[0] == "n3 not flagged by Slurm: left in the job (the requeue waits on Slurm to end the job there)"


def test_a_kill_still_under_way_is_waited_for_and_a_node_it_reached_is_not_released():
    answers = iter([handback.PENDING] * 4 + [handback.DELIVERED])  # answers on the third look
    slurm = Slurm(lambda name, poll: UP)
    got, lines, _ = _release(slurm, ["n3"], reached=lambda n: next(answers))
    assert got == [] and slurm.released == [] and slurm.polls == 2


def test_never_flagged_nothing_is_released_and_the_wait_is_bounded():
    slurm = Slurm(lambda name, poll: UP)
    got, lines, clock = _release(slurm, ["n3"], wait_s=10.0)
    assert got == [] and slurm.released == []
    assert 10.0 <= clock.now <= 10.0 + handback.POLL_S
    assert lines == ["n3 not flagged by Slurm after 10 s: left in the job (the requeue waits "
                     "on Slurm to end the job there)"]


def test_slurm_unreadable_or_refusing_releases_nothing_and_says_so():
    got, lines, _ = _release(Slurm(lambda name, poll: SlurmUnavailable("no answer")), ["n3"])
    assert got == [] and len(lines) == 1 and "could not read the state of n3" in lines[0]
    slurm = Slurm(lambda name, poll: DEAD, release_error=OutcomeUnknown("scontrol update: timed out"))
    got, lines, _ = _release(slurm, ["n3"])
    assert got == [] and len(lines) == 1 and "could not release n3 from the job" in lines[0]


def test_no_client_or_no_node_asks_nothing():
    assert _release(None, ["n3"])[0] == []
    slurm = Slurm(lambda name, poll: DEAD)
    assert _release(slurm, [])[0] == [] and slurm.polls == 0


def test_step_kills_say_whether_slurm_could_signal_the_step():
    gate = threading.Event()

    class Steps:
        def signal_step(self, job_id, step_id, signal="KILL"):
            if step_id == "2":
                gate.wait(10)
                return
            if step_id == "4":
                raise SlurmError("scancel: error: Kill job error on job id 7.4: Job/step already completing or completed")
            raise OutcomeUnknown("scancel --signal=KILL: no answer within 10 s")

    lines: list[str] = []
    kills = handback.StepKills(Steps(), "7", lines.append)
    assert kills.reached("n2") == handback.UNSENT
    kills.send("n2", "2")
    kills.send("n3", "3")
    kills.send("n4", "4")
    kills._threads["n3"].join(10)
    kills._threads["n4"].join(10)
    assert kills.reached("n2") == handback.PENDING and kills.reached("n3") == handback.FAILED
    assert kills.reached("n4") == handback.REFUSED
    assert "WARNING: could not kill step 3 on n3 through Slurm: scancel --signal=KILL: no answer " \
           "within 10 s" in lines
    gate.set()
    kills._threads["n2"].join(10)
    assert kills.reached("n2") == handback.DELIVERED


def test_a_signal_to_the_job_ends_the_wait_at_once():
    """The job's time limit (the template's USR2), a preemption or a scancel while Slurm has not
    flagged the node yet: the requeue must go out now, not after the wait (Slurm's TERM and KILL
    would end the job first: TIMEOUT, never requeued)."""
    slurm = Slurm(lambda name, poll: UP if poll <= 3 else DEAD)
    signalled = lambda: slurm.polls >= 2  # noqa: E731 -- the USR2 came during the second look
    got, lines, clock = _release(slurm, ["n3"], stop=signalled)
    assert got == [] and slurm.released == [] and slurm.polls == 2
    assert clock.now == handback.POLL_S
    assert "a signal came while waiting for Slurm to flag n3: the requeue goes out now" in lines[0]


def test_the_wait_ends_before_the_jobs_time_limit():
    from datetime import datetime, timedelta, timezone

    from slurmft.slurm.client import Job, JobState

    now = datetime(2026, 11, 27, 12, 0, tzinfo=timezone.utc)

    class Limited:
        def __init__(self, end):
            self.end = end

        def job(self, job_id):
            if self.end == "unreadable":
                raise SlurmUnavailable("slurmctld not answering")
            return Job(job_id=job_id, name="train", state=JobState.RUNNING, time_limit_end=self.end)

    assert handback.wait_bound(Limited(None), "7", now) == handback.WAIT_S  # no limit
    assert handback.wait_bound(Limited("unreadable"), "7", now) == handback.WAIT_S
    assert handback.wait_bound(Limited(now + timedelta(hours=20)), "7", now) == handback.WAIT_S
    assert handback.wait_bound(Limited(now + timedelta(seconds=250)), "7", now) == 250 - handback.END_MARGIN_S
    assert handback.wait_bound(Limited(now + timedelta(seconds=100)), "7", now) == 0.0
    naive = (now + timedelta(seconds=300)).replace(tzinfo=None)  # a backend's naive UTC stamp
    assert handback.wait_bound(Limited(naive), "7", now) == 300 - handback.END_MARGIN_S
