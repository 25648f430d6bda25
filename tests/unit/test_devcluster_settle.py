"""``reset()``'s per-node rules and its bounded loop, on states captured from a real devcluster
(the controller itself is exercised by tests/integration/test_devcluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.slurm.devcluster.errors import DevClusterError
from slurmft.slurm.devcluster.query import JobStatus, NodeStatus, parse_nodes
from slurmft.slurm.devcluster.settle import node_action, settle

FIXTURES = Path(__file__).parent.parent / "fixtures" / "devcluster"
NAMES = ["n1", "n2", "n3", "n4"]

pytestmark = pytest.mark.timeout(10)


def node(name: str, text: str) -> NodeStatus:
    return parse_nodes(f"NodeName={name} State={text} Reason=x\n")[name]


def test_a_restarted_controller_s_drained_node_waits_until_it_registers() -> None:
    nodes = parse_nodes((FIXTURES / "scontrol_show_node.restarted_unknown_drain.txt").read_text())
    assert nodes["n3"].describe() == "UNKNOWN+DRAIN"
    assert [node_action(nodes[n]) for n in NAMES] == ["wait"] * 4


@pytest.mark.parametrize("state, action", [
    ("IDLE", "none"),
    ("IDLE+DRAIN", "resume"),
    ("MIXED+DRAIN", "resume"),
    ("DOWN*", "resume"),
    ("DOWN*+DRAIN", "resume"),
    ("IDLE+FAIL", "resume"),
    ("IDLE*", "wait"),
    ("IDLE+COMPLETING", "wait"),
    ("ALLOCATED", "wait"),
    ("UNKNOWN*", "wait"),
])
def test_node_actions(state: str, action: str) -> None:
    assert node_action(node("n1", state)) == action


class FakeController:
    """Node states that move on between reads, the way a restarted slurmctld's do."""

    def __init__(self, rounds: list[dict[str, str]], jobs: list[list[JobStatus]] | None = None,
                 refused: frozenset[tuple[int, str]] = frozenset()):
        self.rounds, self.jobs_by_round, self.refused = rounds, jobs or [], refused
        self.round = 0
        self.resumed: list[tuple[int, str]] = []
        self.cancelled: list[list[str]] = []
        self.now = 0.0

    def read_nodes(self) -> dict[str, NodeStatus]:
        states = self.rounds[min(self.round, len(self.rounds) - 1)]
        return {n: node(n, s) for n, s in states.items()}

    def read_jobs(self) -> list[JobStatus]:
        return self.jobs_by_round[self.round] if self.round < len(self.jobs_by_round) else []

    def resume(self, name: str) -> None:
        self.resumed.append((self.round, name))
        if (self.round, name) in self.refused:
            raise DevClusterError(f"scontrol update NodeName={name} State=RESUME failed: "
                                  "slurm_update error: Invalid node state specified")

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.round += 1

    def run(self, timeout: float = 5.0) -> None:
        settle(NAMES, read_jobs=self.read_jobs, read_nodes=self.read_nodes,
               cancel=self.cancelled.append, resume=self.resume, timeout=timeout,
               logs="/logs", clock=lambda: self.now, sleep=self.sleep)


def test_resume_waits_for_registration_and_a_stale_read_is_not_an_error() -> None:
    idle = {"n1": "IDLE", "n4": "IDLE"}
    fake = FakeController([
        {**idle, "n2": "IDLE+DRAIN", "n3": "UNKNOWN+DRAIN"},
        {**idle, "n2": "IDLE+DRAIN", "n3": "IDLE+DRAIN"},
        {**idle, "n2": "IDLE", "n3": "IDLE"},
    ], refused=frozenset({(1, "n2")}))  # n2 was resumed by someone else after that read
    fake.run()
    assert fake.resumed == [(0, "n2"), (1, "n2"), (1, "n3")]


def test_jobs_are_cancelled_until_gone_but_not_while_completing() -> None:
    running = JobStatus("7", "wrap", "RUNNING", "0:01", "n1", "n1")
    ending = JobStatus("7", "wrap", "COMPLETING", "0:01", "n1", "n1")
    restored = JobStatus("8", "wrap", "RUNNING", "0:01", "n2", "n2")
    fake = FakeController([{n: "IDLE" for n in NAMES}], jobs=[[running], [ending], [restored]])
    fake.run()
    assert fake.cancelled == [["7"], ["8"]]


def test_timeout_names_every_node_not_idle_with_its_state_and_the_last_error() -> None:
    fake = FakeController([{"n1": "IDLE", "n2": "DOWN*", "n3": "IDLE+COMPLETING"}])

    def refused(name: str) -> None:
        raise DevClusterError("scontrol update NodeName=n2 State=RESUME failed: nope")

    fake.resume = refused  # type: ignore[method-assign]
    with pytest.raises(DevClusterError) as err:
        fake.run(timeout=2.0)
    assert str(err.value) == (
        "reset: timed out after 2 s waiting for every node IDLE and no job (n2=DOWN+NOT_RESPONDING,"
        " n3=IDLE+COMPLETING, n4=not listed); last error: scontrol update NodeName=n2 "
        "State=RESUME failed: nope; logs in /logs")


def test_timeout_adds_what_the_caller_knows_of_the_nodes_not_idle() -> None:
    """The controller only says NOT_RESPONDING; reset's ``explain`` says which slurmd, in which
    state (the matrix's sid run timed out on n1=IDLE+NOT_RESPONDING and nothing more)."""
    fake = FakeController([{"n1": "IDLE*", "n2": "IDLE", "n3": "IDLE", "n4": "IDLE"}])
    asked: list[list[str]] = []

    def explain(names: list[str]) -> str:
        asked.append(names)
        return "n1: slurmd pid 42 stopped (T)"

    with pytest.raises(DevClusterError) as err:
        settle(NAMES, read_jobs=fake.read_jobs, read_nodes=fake.read_nodes, cancel=fake.cancelled.append,
               resume=fake.resume, timeout=2.0, logs="/logs", clock=lambda: fake.now, sleep=fake.sleep,
               explain=explain)
    assert asked == [["n1"]]
    assert str(err.value) == ("reset: timed out after 2 s waiting for every node IDLE and no job "
                              "(n1=IDLE+NOT_RESPONDING); n1: slurmd pid 42 stopped (T); logs in /logs")


def test_a_failing_check_ends_the_wait_at_once() -> None:
    fake = FakeController([{"n1": "DOWN*", "n2": "IDLE", "n3": "IDLE", "n4": "IDLE"}])

    def check() -> None:
        if fake.round == 2:
            raise DevClusterError("the slurmd it started for n1 exited")

    with pytest.raises(DevClusterError, match="the slurmd it started for n1 exited"):
        settle(NAMES, read_jobs=fake.read_jobs, read_nodes=fake.read_nodes, cancel=fake.cancelled.append,
               resume=fake.resume, timeout=60.0, logs="/logs", clock=lambda: fake.now, sleep=fake.sleep,
               check=check)
    assert fake.now < 60.0
