"""The in-allocation agents' hooks on torch's real c10d rendezvous (a TCPStore on loopback, one
handler per node as each torchrun agent has): ``rdzv_leave``, a fenced node's agent leaves the
rendezvous (before a round, waiting in one, or at a keep-alive), so the next round completes with
the spare at once, not after the fenced participant's keep-alive expired; ``rdzv_poll``, the
agents wait one poll (0.1 s for a small job) between reads inside a round, and their monitoring
loops read as often."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from torch.distributed import TCPStore  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousTimeoutError  # noqa: E402
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402

from slurmft import allocation as record  # noqa: E402
from slurmft.launch import allocation as alloc_mod  # noqa: E402
from slurmft.train import rdzv_leave, rdzv_poll  # noqa: E402
from slurmft.rundir import RunDir  # noqa: E402

pytestmark = pytest.mark.timeout(120)

RUN_ID = "leave-test"
JOIN_S = 10        # a round that waits for the fenced node's expiry (90 s) times out first
KEEP_ALIVE = (30, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store(monkeypatch):
    """A TCPStore on loopback and the handlers made on it (their keep-alive timers stopped at the
    end); torch's rendezvous module put back as it was (the hooks patch it)."""
    # As every step of the allocation runs its agents (``nodesteps.STEP_ENV``).
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    for cls, name in ((dr.DynamicRendezvousHandler, "next_rendezvous"),
                      (dr.DynamicRendezvousHandler, "num_nodes_waiting"),
                      (dr.DynamicRendezvousHandler, "_keep_alive"), (dr._RendezvousJoinOp, "__call__"),
                      (dr._BackendRendezvousStateHolder, "_sanitize")):
        monkeypatch.setattr(cls, name, getattr(cls, name))
    monkeypatch.setattr(dr, "_delay", dr._delay)
    port = _free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
    made: list = []
    yield SimpleNamespace(port=port, master=master, made=made,
                          handler=lambda keep_alive=KEEP_ALIVE: _handler(port, made, keep_alive=keep_alive))
    for h in made:
        h._stop_heartbeats()


def _handler(port: int, made: list, nodes: int = 2, keep_alive: tuple[int, int] = KEEP_ALIVE):
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    backend = C10dRendezvousBackend(client, RUN_ID)
    timeout = dr.RendezvousTimeout(join=timedelta(seconds=JOIN_S), last_call=timedelta(seconds=1),
                                   close=timedelta(seconds=5), heartbeat=timedelta(seconds=5))
    h = dr.DynamicRendezvousHandler.from_backend(
        RUN_ID, client, backend, min_nodes=nodes, max_nodes=nodes, local_addr="127.0.0.1",
        timeout=timeout, keep_alive_interval=keep_alive[0], keep_alive_max_attempt=keep_alive[1])
    made.append(h)
    return h


def _round(*handlers) -> list:
    """Every handler's next round at once; each one's (rank, world size) or its exception."""
    out: list = [None] * len(handlers)

    def join(i, h):
        try:
            info = h.next_rendezvous()
            out[i] = (info.rank, info.world_size)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[i] = exc
    threads = [threading.Thread(target=join, args=(i, h)) for i, h in enumerate(handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S + 30)
    return out


def _record(tmp_path, fenced: str | None = None) -> RunDir:
    """The run's allocation.json of job 7: a and b active, c the spare, ``fenced`` replaced."""
    run = RunDir(tmp_path)
    alloc = alloc_mod.initial("7", ("a", "b"), ("c",), 2)
    if fenced:
        alloc = alloc_mod.fence(alloc, fenced, "node_unhealthy", 0.0, ["drained"], "c")
    record.write(run, alloc)
    return run


def _state(st, keep_alive=KEEP_ALIVE):
    """The rendezvous state as the store has it now (a new handler: no cached state)."""
    reader = st.handler(keep_alive)
    reader._state_holder.sync()
    return reader._state_holder.state


def _hook(run: RunDir, node: str, said: list) -> bool:
    return rdzv_leave.install({rdzv_leave.LEAVE_ENV: node, rdzv_leave.RUN_DIR_ENV: str(run.root),
                              "SLURMFT_JOB_ID": "7"}, said.append)


def _a_round_then_hooked(store, tmp_path, node: str) -> tuple:
    """a and b in a finished round, the run's record fencing nobody yet, and ``node``'s agent
    hooked: (a, b, what the hook said)."""
    a, b = store.handler(), store.handler()
    assert sorted(_round(a, b)) == [(0, 2), (1, 2)]
    said: list[str] = []
    assert _hook(_record(tmp_path), node, said)
    return a, b, said


def test_a_fenced_node_leaves_and_the_spare_completes_the_next_round_at_once(store, tmp_path):
    a, b = store.handler(), store.handler()
    assert sorted(_round(a, b)) == [(0, 2), (1, 2)]
    run = _record(tmp_path, fenced="b")
    hooked = ((dr.DynamicRendezvousHandler, "next_rendezvous"), (dr.DynamicRendezvousHandler, "_keep_alive"),
              (dr._RendezvousJoinOp, "__call__"))
    torchs = [getattr(cls, name) for cls, name in hooked]
    said: list[str] = []
    assert _hook(run, "b", said)
    assert _hook(run, "b", said)   # once
    with pytest.raises(SignalException) as ended:
        b.next_rendezvous()
    assert rdzv_leave.is_fenced_end(ended.value)  # torchrun keeps the rendezvous open on it
    assert said == ["b is fenced by the launcher (before a round): left the rendezvous, not joining "
                    "another round (torchrun logs this end as a SIGTERM)"]
    assert len(_state(store).participants) == 1
    # The hooks are the process's, and b's: a's and the spare's next round is torch's own again
    # (but for the state reads' drop of fenced nodes, which skips b's own: the hooked node).
    for (cls, name), torchs_own in zip(hooked, torchs):
        setattr(cls, name, torchs_own)
    c = store.handler()
    out = _round(a, c)
    assert sorted(map(str, out)) == ["(0, 2)", "(1, 2)"], out   # not a join timeout: b left


def test_a_node_fenced_while_it_waits_in_a_round_leaves_the_wait_list(store, tmp_path):
    a, b, said = _a_round_then_hooked(store, tmp_path, "a")
    out: list = []
    waiting = threading.Thread(target=lambda: out.append(_round(a)[0]))
    waiting.start()   # a leaves the finished round and waits for the next (b is still in it)
    deadline = time.monotonic() + JOIN_S
    while not _state(store).wait_list and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_state(store).wait_list) == 1
    _record(tmp_path, fenced="a")
    waiting.join(JOIN_S + 30)
    [ended] = out
    assert isinstance(ended, SignalException) and rdzv_leave.is_fenced_end(ended), out
    assert said == ["a is fenced by the launcher (in a round): left the rendezvous, not joining "
                    "another round (torchrun logs this end as a SIGTERM)"]
    state = _state(store)
    assert not state.wait_list and len(state.participants) == 1


def test_a_fenced_node_whose_workers_do_not_stop_leaves_at_its_keep_alive(store, tmp_path):
    """Its agent never reaches another round (a rank in D state): its keep-alive timer leaves."""
    a, b, said = _a_round_then_hooked(store, tmp_path, "b")
    b._keep_alive()                       # not fenced: torch's keep-alive
    assert len(_state(store).participants) == 2 and said == []
    _record(tmp_path, fenced="b")
    b._keep_alive()                       # as its timer's thread calls it
    b._keep_alive()                       # once left, nothing more
    assert said == ["b is fenced by the launcher (at a keep-alive): left the rendezvous"]
    assert len(_state(store).participants) == 1


def test_without_leaving_the_fenced_participant_holds_the_next_round(store, tmp_path):
    """The same fence without the hook (b's agent killed where it stood): the round cannot
    complete before b's keep-alive expires, so it times out first. What the hook is for."""
    a, b = store.handler(), store.handler()
    assert sorted(_round(a, b)) == [(0, 2), (1, 2)]
    b._stop_heartbeats()
    c = store.handler()
    out = _round(a, c)
    assert all(isinstance(r, RendezvousTimeoutError) for r in out), out


def test_a_dead_fenced_nodes_entry_is_dropped_by_the_others_so_the_spare_completes_the_round(store, tmp_path):
    """b dies where it stood (no leave, no keep-alive: a node death); its entry would expire only
    90 s after its last keep-alive, past the join's 10 s. Fenced, it is dropped at the next read of
    the state that sees it missed a keep-alive, and a's round with the spare c completes."""
    quick = (1, 90)   # a keep-alive every second (b misses some at once), expiry far past the join
    a, b = store.handler(quick), store.handler(quick)
    assert sorted(_round(a, b)) == [(0, 2), (1, 2)]
    said: list[str] = []
    assert _hook(_record(tmp_path), "a", said)   # a's agent (this process) is hooked; no fence
    b._stop_heartbeats()
    time.sleep(2.5)   # b's last keep-alive is older than the interval and the margin now
    _record(tmp_path, fenced="b")
    assert len(_state(store, quick).participants) == 2   # fenced, but b published no identity
    _record(tmp_path)
    rdzv_leave.publish(b, "b")   # as b's own agent does before its first round
    assert len(_state(store, quick).participants) == 2   # published, not fenced: kept
    _record(tmp_path, fenced="b")
    state = _state(store, quick)
    assert b._this_node not in state.participants and b._this_node not in state.last_heartbeats
    assert len(state.participants) == 1   # a's, until a leaves the finished round
    c = store.handler(quick)
    out = _round(a, c)
    assert sorted(map(str, out)) == ["(0, 2)", "(1, 2)"], out   # not a join timeout: b dropped
    assert said == []   # a is not fenced: it joined
    assert rdzv_leave.fenced_nodes(tmp_path, {"7"}) == ("b",) and rdzv_leave.fenced_nodes(tmp_path, {"8"}) == ()
    # Each agent published its own identity before its first round (here a's and c's are both
    # this process's, node "a": the later one's stands).
    assert rdzv_leave.published(a._store, a._settings.run_id, "a", dr) in (a._this_node, c._this_node)


def test_a_record_that_cannot_be_read_is_no_fence_for_the_drop(store, tmp_path):
    """b published and silent, the run's record unreadable: b is kept (its entry expires)."""
    quick = (1, 90)
    a, b = store.handler(quick), store.handler(quick)
    assert sorted(_round(a, b)) == [(0, 2), (1, 2)]
    assert _hook(_record(tmp_path), "a", [])
    RunDir(tmp_path).allocation.write_text("{not json")
    rdzv_leave.publish(b, "b")
    b._stop_heartbeats()
    time.sleep(2.5)
    assert len(_state(store, quick).participants) == 2


def test_a_published_identity_that_is_not_one_is_never_used(store):
    h = store.handler()
    key = rdzv_leave.DESC_KEY.format(run_id=RUN_ID, node="x")
    assert rdzv_leave.published(h._store, RUN_ID, "x", dr) is None   # none published
    for junk in ("", "no separators", "host|pid|1", "host|1|two", "host|1|2.5"):
        h._store.set(key, junk)
        assert rdzv_leave.published(h._store, RUN_ID, "x", dr) is None, junk
    h._store.set(key, "n3|41|0")
    assert rdzv_leave.published(h._store, RUN_ID, "x", dr) == dr._NodeDesc("n3", 41, 0)


def test_another_jobs_record_or_an_unreadable_one_is_no_fence(tmp_path):
    run = _record(tmp_path, fenced="b")
    assert rdzv_leave.is_fenced(run.root, "b", {"7"})
    assert not rdzv_leave.is_fenced(run.root, "a", {"7"})
    assert not rdzv_leave.is_fenced(run.root, "b", {"8"})
    run.allocation.write_text("{not json")
    assert not rdzv_leave.is_fenced(run.root, "b", {"7"})
    assert not rdzv_leave.install({rdzv_leave.RUN_DIR_ENV: str(run.root)})   # no node: not hooked


def test_the_agents_poll_a_forming_round_every_poll_and_watch_for_one_as_often(store, monkeypatch):
    poll = rdzv_poll.poll_for(3)                                  # what the launcher says: 0.1 s
    torch_delay = dr._delay
    assert not rdzv_poll.install({})                               # not set: torch's own
    assert rdzv_poll.install({rdzv_poll.ENV: str(poll)}) and dr._delay is not torch_delay
    assert rdzv_poll.install({rdzv_poll.ENV: str(poll)})            # once
    caches: list = []
    get_world = dr.DynamicRendezvousHandler._get_world   # called at the end of a joined round
    monkeypatch.setattr(dr.DynamicRendezvousHandler, "_get_world",
                        lambda self: caches.append(self._state_holder._cache_duration) or get_world(self))
    a, b = store.handler(), store.handler()
    assert sorted(_round(a, b)) == [(0, 2), (1, 2)]
    assert caches == [poll / 2, poll / 2]                         # inside the round: half the poll
    assert a._state_holder._cache_duration == b._state_holder._cache_duration == rdzv_poll.TORCH_POLL_S
    sync = a._state_holder.sync
    monkeypatch.setattr(a._state_holder, "sync",
                        lambda: caches.append(a._state_holder._cache_duration) or sync())
    again: list = []          # b's ranks failed: its agent opens the next round and waits in it
    restart = threading.Thread(target=lambda: again.extend(_round(b)))
    restart.start()
    deadline = time.monotonic() + 5
    while a.num_nodes_waiting() == 0:                             # a's monitoring loop
        assert time.monotonic() < deadline, "a never saw b waiting"
        time.sleep(0.05)
    assert set(caches[2:]) == {poll}                              # its reads: one poll apart
    assert a._state_holder._cache_duration == rdzv_poll.TORCH_POLL_S
    assert [r[1] for r in _round(a)] == [2]                       # a joins: the round completes
    restart.join(JOIN_S)
    assert [r[1] for r in again] == [2]
    sleeps: list = []
    monkeypatch.setattr(rdzv_poll, "time", SimpleNamespace(sleep=sleeps.append))
    dr._delay(seconds=1)                                          # the wait between two reads
    dr._delay(seconds=(0, 0))                                     # any other: torch's own
    assert sleeps == [poll]


def test_the_poll_grows_with_the_nodes_to_torchs_own():
    assert [rdzv_poll.poll_for(n) for n in (2, 32, 64, 128, 1024)] == [0.1, 0.25, 0.5, 1.0, 1.0]


@pytest.mark.parametrize("raw", ["", "0", "0.01", "2", "nan", "x", "-1"])
def test_a_poll_out_of_its_range_is_torchs_own(raw):
    assert rdzv_poll.parse(raw) is None
