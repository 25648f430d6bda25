"""The in-allocation mode's second liveness channel (issue 27): the nodes' tasks beat over TCP to
the launcher (``beatnet`` listens, ``beatsend`` sends), on real sockets on this host. A node is
silent only when neither its alive file nor its TCP beats moved within the bound; before its
first TCP beat the file alone needs the longer ``FILE_ALONE_S``; a connection without the token
counts for nothing; the port and the token reach the task only through its step's environment.
The devcluster's in-allocation tests (tests/integration/test_inalloc.py) run both channels on
real Slurm steps."""

import json
import socket
import sys
import threading
import time

import pytest

from launch_envs import recorded
from slurmft.launch import (alloc_settings, beatnet, beatsend, identity, inalloc, liveness,
                            nodesteps, orphan, procs, settings)
from slurmft.launch.journaling import Voice
from slurmft.launch.rendezvous import Rendezvous
from slurmft.launch.signals import SignalLog
from slurmft.rundir import RunDir

pytestmark = pytest.mark.timeout(60)
NODES = ("n1", "n2", "n3")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def listener():
    net = beatnet.Listener("127.0.0.1", NODES)
    yield net
    net.close()


def _sender(net, node="n2", step="7"):
    return beatsend.take_from({**net.environ_for(node), "SLURM_STEP_ID": step})


def _heard(net, node, count, bound_s=10.0):
    """Wait (bounded) until the listener took ``count`` lines from ``node``."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        seen = net.beat(node)
        if seen is not None and seen.count >= count:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"the listener did not take {count} line(s) from {node} in {bound_s} s")


def _file_beat(run, node, seq):
    run.alive(node).write_text(json.dumps({"seq": seq, "pid": 5, "step_id": "7"}))


def _watching(tmp_path, net):
    run, clock = RunDir(tmp_path), Clock()
    run.alive("n2").parent.mkdir()
    live = liveness.Liveness(run, startup_s=30, clock=clock, net=net)
    live.expect("n2")
    return run, clock, live


def test_a_stalled_file_with_live_tcp_beats_is_not_silent(tmp_path, listener):
    run, clock, live = _watching(tmp_path, listener)
    sender = _sender(listener)
    _file_beat(run, "n2", 1)
    sender.beat("BEAT 1")  # connects: HELLO
    _heard(listener, "n2", 1)
    live.poll()
    for seq in range(2, 8):  # the file stalls; the TCP beats go on
        clock.now += 1.5
        sender.beat(f"BEAT {seq}")
        _heard(listener, "n2", seq)
        live.poll()
        assert not live.silent("n2", 5)
    assert live.silent_s("n2") == pytest.approx(0) and live.step_id("n2") == "7"
    assert "its alive file 9.0 s" in live.describe("n2")
    clock.now += 5.5  # now TCP is silent too
    live.poll()
    assert live.silent("n2", 5) and live.silent_s("n2") == pytest.approx(5.5)
    assert live.describe("n2") == "its alive file 14.5 s, TCP 5.5 s (connected)"


def test_live_file_beats_with_a_silent_connection_are_not_silent(tmp_path, listener):
    run, clock, live = _watching(tmp_path, listener)
    sender = _sender(listener)
    sender.beat("BEAT 1")
    _heard(listener, "n2", 1)
    live.poll()
    sender.close()  # the connection goes; the file goes on
    deadline = time.monotonic() + 10
    while listener.beat("n2").connected and time.monotonic() < deadline:
        time.sleep(0.02)
    for seq in range(1, 8):
        clock.now += 1.5
        _file_beat(run, "n2", seq)
        live.poll()
        assert not live.silent("n2", 5)
    clock.now += 5.5
    live.poll()
    assert live.silent("n2", 5)
    assert live.describe("n2") == "its alive file 5.5 s, TCP 16.0 s (connection closed)"


def test_before_its_first_tcp_beat_a_nodes_file_alone_needs_the_longer_bound(tmp_path, listener):
    run, clock, live = _watching(tmp_path, listener)
    _file_beat(run, "n2", 1)
    live.poll()
    clock.now += 6
    assert not live.silent("n2", 5)  # a filesystem's stall is no evidence on its own
    clock.now += liveness.FILE_ALONE_S - 6 + 0.5
    assert live.silent("n2", 5)
    assert "no TCP beat yet (the file alone, at least 10 s)" in live.describe("n2")


def test_a_connection_without_the_token_or_a_node_of_ours_is_dropped_and_counts_for_nothing(listener):
    other = beatnet.new_token()
    for hello in (f"HELLO {other} n2 1 -", f"HELLO {listener.token} n9 1 -",
                  f"HELLO {listener.token} n2 x -", "BEAT 1", f"HELLO {listener.token[:-1]} n2 1 -",
                  "x" * (beatnet.MAX_LINE + 1)):
        with socket.create_connection((listener.address, listener.port), timeout=5) as sock:
            sock.sendall(f"{hello}\n".encode())
            sock.settimeout(10)
            assert sock.recv(100) == b""  # closed by the listener, no OK
    assert listener.beat("n2") is None and listener.beat("n9") is None
    sender = beatsend.Sender(listener.address, listener.port, other, "n2", "7")
    sender.beat("BEAT 1")
    sender.beat("BEAT 2")
    assert sender.acks == 0 and listener.beat("n2") is None


def test_a_connection_that_says_nothing_is_dropped_after_its_bound(monkeypatch):
    monkeypatch.setattr(beatnet, "AUTH_S", 0.3)
    net = beatnet.Listener("127.0.0.1", NODES)
    try:
        with socket.create_connection((net.address, net.port), timeout=5) as sock:
            sock.settimeout(10)
            assert sock.recv(100) == b""
    finally:
        net.close()


def test_the_end_line_says_how_the_task_ended_and_the_launcher_has_read_it(tmp_path, listener):
    run, clock, live = _watching(tmp_path, listener)
    sender = _sender(listener)
    sender.finish(3)  # before the task exits: the listener took it (its OK came back)
    assert listener.beat("n2").ended == 3
    live.poll()
    assert live.ended("n2") == 3  # a crash, not a node's death, though the file never said so


def test_the_task_takes_the_channel_out_of_its_environment():
    env = {beatnet.HOST_ENV: "127.0.0.1", beatnet.PORT_ENV: "4000", beatnet.TOKEN_ENV: "a" * 32,
           beatnet.NODE_ENV: "n2", "SLURM_STEP_ID": "3;x", "KEEP": "1"}
    sender = beatsend.take_from(env)
    assert env == {"SLURM_STEP_ID": "3;x", "KEEP": "1"} and sender.step_id == "-"
    assert beatsend.take_from({beatnet.PORT_ENV: "nope"}) is None


def test_the_batch_host_is_dead_to_another_node_only_when_both_channels_are_silent(tmp_path):
    path, clock, acks = tmp_path / "n1.json", Clock(), [0]
    watch = orphan.BatchWatch(path, silent_s=5, place=1, clock=clock, acks=lambda: acks[0])
    path.write_text(json.dumps({"seq": 1, "pid": 9}))
    acks[0] += 1
    assert watch.silent_s() is None
    clock.now += 12  # the batch host's file stalls; the launcher's OKs go on
    acks[0] += 1
    assert watch.silent_s() is None
    clock.now += 5 + orphan.STAGGER_S + 0.5  # and now they stop too
    assert watch.silent_s() == pytest.approx(8.5)
    assert watch.describe() == "its alive file 20.5 s, the launcher's TCP OKs 8.5 s"
    path.write_text(json.dumps({"seq": 2, "pid": 9}))  # the reverse: a refused connection, a live file
    assert watch.silent_s() is None
    clock.now += 5 + orphan.STAGGER_S - 0.5
    assert watch.silent_s() is None


def test_the_port_and_the_token_reach_the_task_only_through_its_steps_environment(tmp_path, monkeypatch):
    """A real Supervisor starts a real node task (srun left out): the task beats over TCP, its
    child sees no token, and no file of the run dir holds the port or the token."""
    real_bind = beatnet.bind_address
    monkeypatch.setattr(beatnet, "bind_address", lambda host: real_bind("127.0.0.1"))
    seen_env = tmp_path / "child-env.json"
    child = ("import json, os, sys, time; json.dump(dict(os.environ), open(sys.argv[1], 'w')); "
             "time.sleep(30)")
    monkeypatch.setattr(nodesteps, "node_argv", lambda *a, **k: [
        sys.executable, "-m", "slurmft.launch.task", sys.executable, "-c", child, str(seen_env),
        "--rdzv-conf=unused"])
    run_dir = tmp_path / "run"
    env = {**recorded("nonarray"), "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3",
           "SLURM_NNODES": "3", "SLURMFT_RUN_DIR": str(run_dir), "SLURMFT_IN_ALLOCATION": "1",
           "PATH": "/usr/bin:/bin"}
    ident = identity.from_environ(env)
    sup = inalloc.Supervisor(ident, settings.from_environ(env, ident),
                             alloc_settings.from_environ(env, ident), Rendezvous("n1", 40001, "r"),
                             ["train.py"], env, SignalLog(), Voice(ident, run_dir), None,
                             lambda name: None, lambda: None)
    run_dir.mkdir()
    sup._open_net()
    try:
        assert sup.net is not None
        sup._start("n2")
        deadline = time.monotonic() + 30
        while (sup.net.beat("n2") is None or not seen_env.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        sup.liveness.poll()
        assert sup.liveness.has_beaten("n2") and "TCP" in sup.liveness.describe("n2"), \
            "the task never beat over TCP"
        child_env = json.loads(seen_env.read_text())
        assert not set(beatnet.ENV_NAMES) & set(child_env)  # torchrun and the ranks never see it
        secrets_ = (sup.net.token, f":{sup.net.port}", f'"{sup.net.port}"')
        for path in [p for p in run_dir.rglob("*") if p.is_file()]:
            text = path.read_text(errors="replace")
            assert not [s for s in secrets_ if s in text], path
        assert run_dir.joinpath("alive", "n2.json").exists()  # the file channel still beats
    finally:
        for step in sup.steps.values():
            procs.stop(step.proc, kill_after_s=5)
        sup._stop_rest()
    assert sup.net is None


def test_the_sender_thread_beats_every_period_until_stopped(listener):
    sender, stop = _sender(listener), threading.Event()
    thread = threading.Thread(target=sender.run, args=(stop, 0.05))
    thread.start()
    _heard(listener, "n2", 5)
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and sender.acks >= 3 and sender.status == "connected"


def test_a_listener_that_cannot_be_opened_is_one_line_and_the_file_alone_longer():
    said = []
    assert liveness.open_channel("no-such-host.invalid", NODES, said.append) is None
    [line] = said
    assert line.startswith("WARNING: no TCP beat channel (cannot resolve the batch host "
                           "no-such-host.invalid") and "at least 10 s" in line
    said.clear()
    net = liveness.open_channel("127.0.0.1", NODES, said.append)
    try:
        assert net is not None and str(net.port) not in said[0] and net.token not in said[0]
        assert "loopback" in said[0]
    finally:
        net.close()


def test_a_task_requeues_only_once_the_launchers_connection_is_refused_too(tmp_path, monkeypatch):
    """The batch host's file is silent from the start; the launcher's OKs keep its other-node
    task from requeueing until the listener goes (a refused connection is the evidence)."""
    import os
    import signal

    from slurmft.launch import task

    net = beatnet.Listener("127.0.0.1", NODES)
    batch = tmp_path / "alive" / "n1.json"
    batch.parent.mkdir()
    monkeypatch.setattr(orphan, "STARTUP_S", 0.5)
    monkeypatch.setattr(orphan, "POLL_S", 0.1)
    asked = []
    monkeypatch.setattr(orphan, "requeue_job",
                        lambda env, silent, detail: asked.append((time.monotonic(), detail)))
    for key, value in {**orphan.environ_for("n1", batch, 2, 0), **net.environ_for("n2")}.items():
        monkeypatch.setenv(key, value)
    start = time.monotonic()
    closed = []
    closer = threading.Timer(4.0, lambda: (closed.append(time.monotonic()), net.close()))
    closer.start()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = task.supervise([sys.executable, "-c", "import time; time.sleep(60)"],
                            tmp_path / "alive" / "n2.json")
    finally:
        closer.cancel()
        net.close()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert rc == 128 + 15 and closed and len(asked) == 1
    when, detail = asked[0]
    assert when >= closed[0] > start  # not while the OKs came, though the file said nothing
    assert "no OK" not in detail and "the launcher's TCP OKs" in detail
    assert "refused" in detail or "closed by the launcher" in detail
    assert beatnet.TOKEN_ENV not in os.environ  # taken out of the task's environment


def test_a_node_that_beats_in_its_file_but_never_over_tcp_is_said_once(tmp_path, listener):
    said = []
    run, clock, live = _watching(tmp_path, listener)
    live.log = said.append
    for seq in range(1, 40):
        clock.now += 1
        _file_beat(run, "n2", seq)
        live.poll()
    assert len(said) == 1 and said[0].startswith("WARNING: n2 beats in its alive file but not over TCP")
    assert str(listener.port) not in said[0] and not live.silent("n2", 5)
