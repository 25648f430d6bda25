"""AllocationWatch, torch-free: when it ends a rank (a newer generation, a fenced node of its world),
when it does not (another job's record, a file it cannot use, a generation that went back, no
file), and that a look at an unchanged file is one stat. The real ranks stuck in gloo are
tests/unit/test_alloc_watch_dist.py's."""

from __future__ import annotations

import io
import os
import signal
import threading
import time

import pytest

from slurmft import allocation, exitcodes
from slurmft.rundir import RunDir, atomic_write_bytes
from slurmft.train.alloc_watch import AllocationWatch


def write(run: RunDir, generation: int, *, job_id: str = "77", active=("n0", "n1", "n2"),
          spares=("n3",), fenced=()) -> None:
    """As the launcher writes it (slurmft.allocation.write: atomic, checked)."""
    allocation.write(run, allocation.Allocation(
        job_id=job_id, generation=generation, active=tuple(active), spares=tuple(spares),
        fenced=tuple(allocation.Fence(node=n, cause="node_death", time=1.8e9, evidence=("step gone",))
                     for n in fenced), min_nodes=2))


class Exits:
    """Stands in for os._exit: records the code (the real exit is the dist test's)."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def watch(run: RunDir, exits: Exits, said: list[str] | None = None, **kw) -> AllocationWatch | None:
    kw.setdefault("poll_s", 3600)  # the tests look by hand unless they test the thread
    return AllocationWatch.start_for(run, ("77", None), _exit=exits,
                                     on_reform=(said.append if said is not None else None),
                                     stream=io.StringIO(), **kw)


def test_a_newer_generation_ends_the_rank_with_88_after_the_journal_hook(tmp_path):
    run, exits, said = RunDir(tmp_path), Exits(), []
    write(run, 3)
    w = watch(run, exits, said)
    assert w is not None and w.start_generation == 3
    w.set_world(["n0", "n1", "n2"])
    assert w.check() is None and exits.codes == []
    write(run, 4, active=("n0", "n3", "n2"), spares=(), fenced=("n1",))
    reason = w.check()
    assert exits.codes == [exitcodes.REFORM]
    assert reason == "the allocation's generation moved from 3 to 4 (fenced: n1)"
    assert said == [reason]  # the hook (rank 0's segment_end) ran before the exit
    w.stop()


def test_the_poll_thread_ends_a_rank_stuck_elsewhere(tmp_path):
    """The training thread is stuck in a collective: only the watch's own thread can end it."""
    run, exits = RunDir(tmp_path), Exits()
    write(run, 0)
    w = watch(run, exits, poll_s=0.05)
    assert w is not None
    write(run, 1)
    assert exits.done.wait(30), "the poll thread did not end the rank"
    assert exits.codes == [exitcodes.REFORM]
    w.stop()


def test_a_fenced_node_of_the_world_ends_the_rank_even_at_its_start_generation(tmp_path):
    """The generation moved between torchrun's rendezvous and the rank's first look: the start
    generation is the new one, but the world still holds the fenced node."""
    run, exits = RunDir(tmp_path), Exits()
    write(run, 5, active=("n0", "n3", "n2"), spares=(), fenced=("n1",))
    w = watch(run, exits)
    assert w is not None and exits.codes == []  # n1 is not known to be in this world yet
    w.set_world(["n0", "n1", "n2"])
    assert exits.codes == [exitcodes.REFORM]
    assert w.fired == "node(s) of this rank's world were fenced by the launcher: n1"


def test_a_fenced_spare_or_a_node_of_another_world_is_no_reason(tmp_path):
    run, exits = RunDir(tmp_path), Exits()
    write(run, 2)
    w = watch(run, exits)
    assert w is not None
    w.set_world(["n0", "n1", "n2"])
    write(run, 2, spares=(), fenced=("n3",))  # the spare died: no rank of ours ran there
    assert w.check() is None and exits.codes == []
    w.stop()


def test_a_world_torchrun_reformed_before_the_fence_is_not_ended_by_it(tmp_path):
    """torchrun's keep-alive expiry is the launcher's silence bound: the survivors' agents may form
    a shrunk world without the dead n2 just before the launcher fences it. The fence's generation
    fences no node of that world and its active nodes are that world's: no restart."""
    run, exits = RunDir(tmp_path), Exits()
    write(run, 0, spares=())
    w = watch(run, exits)
    assert w is not None and w.start_generation == 0
    w.set_world(["n0", "n1"])
    write(run, 1, active=("n0", "n1"), spares=(), fenced=("n2",))
    assert w.check() is None and exits.codes == []
    w._read_at -= 10   # read again later: still nothing
    assert w.check() is None and exits.codes == []
    write(run, 2, active=("n0", "n1"), spares=(), fenced=("n2", "n1"))   # then n1 dies too
    assert w.check() == "the allocation's generation moved from 0 to 2 (fenced: n1)"
    assert exits.codes == [exitcodes.REFORM]


def test_a_new_generation_that_re_forms_this_world_on_other_nodes_ends_it(tmp_path):
    """The launcher decided a restart for this world: a spare takes the fenced node's place (the
    world torchrun formed without it must restart to take the spare in)."""
    run, exits = RunDir(tmp_path), Exits()
    write(run, 0)
    w = watch(run, exits)
    assert w is not None
    w.set_world(["n0", "n1"])
    write(run, 1, active=("n0", "n1", "n3"), spares=(), fenced=("n2",))
    assert w.check() == "the allocation's generation moved from 0 to 1 (the world is re-formed on n0, n1, n3)"
    assert exits.codes == [exitcodes.REFORM]


def test_before_its_world_is_known_a_rank_leaves_on_any_new_generation(tmp_path):
    """Before Run's all-gather (which a dead peer may block) the rank cannot tell: it leaves."""
    run, exits = RunDir(tmp_path), Exits()
    write(run, 0)
    w = watch(run, exits)
    assert w is not None
    write(run, 1, active=("n0", "n1"), spares=(), fenced=("n2",))
    assert w.check() == "the allocation's generation moved from 0 to 1"
    assert exits.codes == [exitcodes.REFORM]


def test_no_file_or_another_jobs_file_turns_the_watch_off(tmp_path):
    run, exits = RunDir(tmp_path), Exits()
    assert watch(run, exits) is None  # the default (requeue) mode: no thread, no cost
    write(run, 1, job_id="76")  # a record an earlier job left in the run dir
    assert watch(run, exits) is None
    write(run, 1, job_id="77")
    assert AllocationWatch.start_for(run, ("4_1", "77"), _exit=exits, poll_s=3600) is not None


@pytest.mark.parametrize("bad", [b"{not json", b'{"version": 1, "job_id": "77", "generation": -1}',
                                 b'{"version": 9, "job_id": "77", "generation": 8}', b"[]"])
def test_a_file_that_does_not_check_is_said_once_and_ends_nothing(tmp_path, bad):
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1)
    stream = io.StringIO()
    w = AllocationWatch.start_for(run, ("77",), _exit=exits, poll_s=3600, stream=stream)
    assert w is not None
    atomic_write_bytes(run.allocation, bad)
    assert w.check() is None
    atomic_write_bytes(run.allocation, bad + b" ")
    assert w.check() is None and exits.codes == []
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "allocation.json" in lines[0] and "still watching" in lines[0]
    write(run, 2)  # the launcher's next record still counts
    assert w.check() is not None and exits.codes == [exitcodes.REFORM]


def test_a_link_or_a_fifo_in_its_place_is_refused_not_followed(tmp_path):
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1)
    w = watch(run, exits)
    assert w is not None
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(run.allocation, elsewhere)
    write(RunDir(tmp_path / "other"), 9)
    os.symlink(tmp_path / "other" / "allocation.json", run.allocation)
    assert w.check() is None
    os.unlink(run.allocation)
    os.mkfifo(run.allocation)
    assert w.check() is None and exits.codes == []  # and it did not block on the FIFO


def test_a_generation_that_went_back_or_a_file_that_went_away_is_no_reason(tmp_path):
    run, exits = RunDir(tmp_path), Exits()
    write(run, 4)
    w = watch(run, exits)
    assert w is not None
    write(run, 3)
    assert w.check() is None
    os.unlink(run.allocation)
    assert w.check() is None and exits.codes == []


def test_an_unchanged_file_is_not_read_again(tmp_path, monkeypatch):
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1)
    w = watch(run, exits)
    assert w is not None
    reads = []
    real = allocation.read
    monkeypatch.setattr(allocation, "read", lambda r: (reads.append(1), real(r))[1])
    for _ in range(50):
        w.check()
    assert reads == []
    write(run, 1)  # rewritten (a new inode): read once
    w.check()
    w.check()
    assert reads == [1]


def test_a_stale_lstat_still_sees_the_new_generation_within_the_full_read_period(tmp_path, monkeypatch):
    """NFS may answer lstat from its caches after the launcher's rename: the periodic read
    (an open revalidates) finds the new generation anyway."""
    from slurmft.train import alloc_watch
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1)
    w = watch(run, exits)
    assert w is not None
    cached = os.lstat(run.allocation)
    monkeypatch.setattr(alloc_watch.os, "lstat", lambda path: cached)
    write(run, 2)
    assert w.check() is None  # the cached attributes say nothing moved
    w._read_at -= alloc_watch.FULL_READ_S  # that much later
    assert w.check() is not None and exits.codes == [exitcodes.REFORM]


def test_the_exit_does_not_wait_for_a_hook_that_hangs(tmp_path):
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1)
    hung = threading.Event()
    w = AllocationWatch.start_for(run, ("77",), _exit=exits, poll_s=3600, report_timeout_s=0.2,
                                  on_reform=lambda reason: hung.wait(60), stream=io.StringIO())
    assert w is not None
    write(run, 2)
    started = time.monotonic()
    w.check()
    assert exits.codes == [exitcodes.REFORM] and time.monotonic() - started < 30
    hung.set()


class FakeGlooError(RuntimeError):
    pass


def test_a_collective_failure_waits_for_the_verdict_and_ends_with_88(tmp_path):
    """gloo raised at once (the dead peer's sockets were closed): the launcher's new generation,
    a moment later, still makes it a re-formed world, not a crash."""
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1)
    w = watch(run, exits, poll_s=0.05)
    assert w is not None
    threading.Timer(0.5, lambda: write(run, 2, fenced=("n1",))).start()
    failure = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4711")
    reason = w.await_verdict(failure, grace_s=30)
    assert reason is not None and reason.startswith("the allocation's generation moved from 1 to 2")
    assert exits.done.wait(30) and exits.codes == [exitcodes.REFORM]  # the poll thread may be first


def test_a_failure_of_the_ranks_own_is_not_held(tmp_path):
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1)
    w = watch(run, exits)
    assert w is not None
    started = time.monotonic()
    assert w.await_verdict(KeyError("batch"), grace_s=30) is None  # not a collective: at once
    assert w.await_verdict(RuntimeError("shape mismatch"), grace_s=30) is None
    assert time.monotonic() - started < 5
    # A collective failure with no verdict within the grace: the rank's own after all.
    assert w.await_verdict(RuntimeError("Connection reset by peer"), grace_s=0.3) is None
    assert exits.codes == []


def test_a_signal_while_waiting_for_a_verdict_ends_the_rank_with_88_not_as_a_crash(tmp_path):
    """torchrun's agent SIGTERMs its workers after a peer's crash: no verdict comes, and the
    rank must not exit 1 (its node's warm server would journal that as a crash of its own)."""
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1)
    stream = io.StringIO()
    w = AllocationWatch.start_for(run, ("77", None), _exit=exits, poll_s=3600, stream=stream)
    assert w is not None
    started = time.monotonic()
    reason = w.await_verdict(RuntimeError("Connection reset by peer"), grace_s=60, interrupted=lambda: True)
    assert reason == "a signal asked this rank to stop its broken world: leaving"
    assert exits.codes == [exitcodes.REFORM] and time.monotonic() - started < 30
    assert "slurmft allocation watch: " + reason in stream.getvalue()


@pytest.mark.parametrize("exc, world", [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
    (RuntimeError("NCCL communicator was aborted on rank 2"), True),
    (FakeGlooError("Broken pipe"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("Connection closed by peer"), False),
])
def test_what_counts_as_a_collective_with_a_dead_peer(exc, world):
    from slurmft.train.alloc_watch import is_world_failure
    assert is_world_failure(exc) is world


def test_torchs_own_distributed_errors_count():
    import torch.distributed as dist
    from slurmft.train.alloc_watch import is_world_failure
    assert is_world_failure(dist.DistBackendError("anything")) and is_world_failure(dist.DistNetworkError("x"))


def test_the_lowest_rank_on_a_node_not_fenced_journals_the_reform(tmp_path):
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1)
    w = watch(run, exits)
    assert w is not None
    w.nodes_by_rank = ["n0", "n1", "n2"]
    write(run, 2, active=("n1", "n2", "n3"), spares=(), fenced=("n0",))  # rank 0 died with n0
    assert w.check() is not None
    assert [w.reporter(r) for r in range(3)] == [False, True, False]
    w2 = watch(RunDir(tmp_path / "other"), exits)  # no file there: off
    assert w2 is None
    write(RunDir(tmp_path / "b"), 1)
    w3 = watch(RunDir(tmp_path / "b"), exits)
    assert w3 is not None
    w3.nodes_by_rank = ["n0", "n1", "n2"]
    write(RunDir(tmp_path / "b"), 2, active=("n0", "n1", "n3"), spares=(), fenced=("n2",))
    assert w3.check() is not None and [w3.reporter(r) for r in range(3)] == [True, False, False]


def _world_without_n2(tmp_path):
    """A 2-node world (n0, n1) of an allocation whose active nodes are n0, n1, n2."""
    run, exits = RunDir(tmp_path), Exits()
    write(run, 0, spares=())
    stream = io.StringIO()
    w = AllocationWatch.start_for(run, ("77", None), _exit=exits, poll_s=3600, stream=stream)
    assert w is not None
    w.set_world(["n0", "n1"])
    return run, exits, stream, w


def test_a_world_without_an_active_nodes_agent_holds_until_torchruns_term_and_leaves_with_88(tmp_path):
    """The shrink-mode start-up race: torchrun's round closed with n0, n1 (MIN 2) before n2's agent
    joined. The world must not train (it would checkpoint a 2-node world and read the TERM that
    takes n2 in as a preemption): it holds, and torchrun's SIGTERM ends it with 88, nothing saved."""
    run, exits, stream, w = _world_without_n2(tmp_path)
    assert w.missing() == ["n2"]
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()  # torchrun's stop
    started = time.monotonic()
    assert w.hold_while_partial(bound_s=60) is False
    assert exits.codes == [exitcodes.REFORM] and time.monotonic() - started < 30
    assert "holding the first step" in stream.getvalue()
    assert "torchrun stopped this world (SIGTERM) to re-form it with n2" in stream.getvalue()
    assert signal.getsignal(signal.SIGTERM) is before  # put back: the rank's own handler comes later


def test_a_partial_world_trains_once_the_launcher_fences_the_missing_node(tmp_path):
    """The late node died before its agent joined: the launcher's fence makes the held world the
    allocation's (a shrink), and it trains; an unrelated TERM handler is put back."""
    run, exits, stream, w = _world_without_n2(tmp_path)
    threading.Timer(0.5, lambda: write(run, 1, active=("n0", "n1"), spares=(), fenced=("n2",))).start()

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert w.hold_while_partial(bound_s=60) is True
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exits.codes == [] and w.missing() == []
    assert "training" in stream.getvalue().splitlines()[-1]


def test_a_whole_world_does_not_hold_and_a_partial_one_gives_up_after_its_bound(tmp_path):
    run, exits = RunDir(tmp_path), Exits()
    write(run, 0, spares=())
    w = watch(run, exits)
    assert w is not None
    w.set_world(["n0", "n1", "n2"])
    started = time.monotonic()
    assert w.hold_while_partial(bound_s=60) is True and time.monotonic() - started < 5
    w.set_world(["n0", "n1"])
    assert w.hold_while_partial(bound_s=0.3) is False  # trains partial, said as a warning
    assert exits.codes == []


def test_a_spare_whose_agent_is_late_holds_the_survivors_world(tmp_path):
    """After a fence the spare n3 is active; the survivors' round closed before its agent joined."""
    run, exits = RunDir(tmp_path), Exits()
    write(run, 1, active=("n0", "n2", "n3"), spares=(), fenced=("n1",))
    w = watch(run, exits)
    assert w is not None
    w.set_world(["n0", "n2"])
    assert w.missing() == ["n3"]
