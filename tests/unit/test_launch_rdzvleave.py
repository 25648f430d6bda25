"""``rdzvleave`` on torch's real c10d rendezvous (a TCPStore on loopback, one handler per node as
each torchrun agent has): a fenced node's agent leaves the finished round, so the next one
completes with the spare at once, not after the fenced participant's keep-alive expired."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
from torch.distributed import TCPStore  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousTimeoutError  # noqa: E402
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402

from slurmft import allocation as record  # noqa: E402
from slurmft.launch import allocation as alloc_mod  # noqa: E402
from slurmft.launch import rdzvleave  # noqa: E402
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
    # As every step of the allocation runs its agents (``nodesteps.STEP_ENV``).
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    port = _free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
    yield port, master


def _handler(port: int, store_master, nodes: int = 2):
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    backend = C10dRendezvousBackend(client, RUN_ID)
    timeout = dr.RendezvousTimeout(join=timedelta(seconds=JOIN_S), last_call=timedelta(seconds=1),
                                   close=timedelta(seconds=5), heartbeat=timedelta(seconds=5))
    return dr.DynamicRendezvousHandler.from_backend(
        RUN_ID, client, backend, min_nodes=nodes, max_nodes=nodes, local_addr="127.0.0.1",
        timeout=timeout, keep_alive_interval=KEEP_ALIVE[0], keep_alive_max_attempt=KEEP_ALIVE[1])


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


def _fence(tmp_path, node: str, spare: str) -> RunDir:
    run = RunDir(tmp_path)
    alloc = alloc_mod.initial("7", ("a", "b"), (spare,), 2)
    record.write(run, alloc_mod.fence(alloc, node, "node_unhealthy", 0.0, ["drained"], spare))
    return run


def _participants(port: int, store_master) -> int:
    """The round's participants as the store has them now (a new handler: no cached state)."""
    reader = _handler(port, store_master)
    reader._state_holder.sync()
    return len(reader._state_holder.state.participants)


@pytest.fixture
def unhooked(monkeypatch):
    """The class as torch has it, put back after the test (the hook patches the class)."""
    monkeypatch.setattr(dr.DynamicRendezvousHandler, "next_rendezvous",
                        dr.DynamicRendezvousHandler.next_rendezvous)


def test_a_fenced_node_leaves_and_the_spare_completes_the_next_round_at_once(store, tmp_path, unhooked):
    port, master = store
    a, b = _handler(port, master), _handler(port, master)
    assert sorted(_round(a, b)) == [(0, 2), (1, 2)]
    run = _fence(tmp_path, "b", "c")
    original = dr.DynamicRendezvousHandler.next_rendezvous
    said: list[str] = []
    assert rdzvleave.install({rdzvleave.LEAVE_ENV: "b", rdzvleave.RUN_DIR_ENV: str(run.root),
                              "SLURMFT_JOB_ID": "7"}, said.append)
    assert rdzvleave.install({rdzvleave.LEAVE_ENV: "b", rdzvleave.RUN_DIR_ENV: str(run.root)})  # once
    with pytest.raises(SignalException) as ended:
        b.next_rendezvous()
    assert rdzvleave.is_fenced_end(ended.value)  # torchrun keeps the rendezvous open on it
    assert said == ["b is fenced by the launcher: left the rendezvous, not joining another round"]
    assert _participants(port, master) == 1
    # The agents of this process are not b's: the next round is torch's own again.
    dr.DynamicRendezvousHandler.next_rendezvous = original
    c = _handler(port, master)
    out = _round(a, c)
    assert sorted(map(str, out)) == ["(0, 2)", "(1, 2)"], out   # not a join timeout: b left


def test_without_leaving_the_fenced_participant_holds_the_next_round(store, tmp_path):
    """The same fence without the hook (b's agent killed where it stood): the round cannot
    complete before b's keep-alive expires, so it times out first. What the hook is for."""
    port, master = store
    a, b = _handler(port, master), _handler(port, master)
    assert sorted(_round(a, b)) == [(0, 2), (1, 2)]
    b._stop_heartbeats()
    c = _handler(port, master)
    out = _round(a, c)
    assert all(isinstance(r, RendezvousTimeoutError) for r in out), out


def test_another_jobs_record_or_an_unreadable_one_is_no_fence(tmp_path):
    run = _fence(tmp_path, "b", "c")
    assert rdzvleave.is_fenced(run.root, "b", {"7"})
    assert not rdzvleave.is_fenced(run.root, "a", {"7"})
    assert not rdzvleave.is_fenced(run.root, "b", {"8"})
    run.allocation.write_text("{not json")
    assert not rdzvleave.is_fenced(run.root, "b", {"7"})
    assert not rdzvleave.install({rdzvleave.RUN_DIR_ENV: str(run.root)})   # no node: not hooked
