"""torchrun's TERM to a warm rank (slurmft.launch.warmclient.StopWatch, issue 27): a frozen rank
is killed at once instead of after torchrun's fixed 30 s, a real stop keeps its save window.

Real server, client and worker processes; the rank is started and stopped by torchrun's own
``SubprocessHandler`` (what ``LocalElasticAgent`` starts its workers with: its own session, and
``close()`` is the ``killpg(TERM)`` of ``_stop_workers``), and torchrun's KILL, which comes 30 s
later, is left out: every rank here must end by the client's doing or by its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from procs import wait_until
from test_launch_warm import CLIENT, WAIT_S, Srv, _script

from slurmft.launch import warm, warmclient, warmtask

torch_mp = pytest.importorskip("torch.distributed.elastic.multiprocessing.subprocess_handler")

READY = """
import json, os, signal, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
"""


def _rank(body: str) -> str:
    """A rank's script: it says its pid in the file named by its first argument, then ``body``."""
    return READY + textwrap.dedent(body)


@pytest.fixture(scope="module")
def srv():
    server = Srv("json")
    yield server
    server.stop()


def _stat(pid: int, field: int) -> str | None:
    """A field of /proc/PID/stat after the command's name (0: the state, 1: the parent's pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[field]
    except OSError:
        return None


def _state(pid: int) -> str | None:
    return _stat(pid, 0)


def _torchrun_starts(srv: Srv, script: Path, tmp_path: Path, **env: str):
    """A rank as torchrun starts one, and its worker's pid once it is running."""
    ready = tmp_path / "ready"
    handler = torch_mp.SubprocessHandler(
        entrypoint=CLIENT[0], args=(*CLIENT[1:], str(script), str(ready)),
        env=srv.env(**env), stdout=str(tmp_path / "rank.out"), stderr=str(tmp_path / "rank.err"),
        local_rank_id=0, numa_options=None)
    wait_until("the worker's ready file", lambda: (ready.exists() and ready.read_text() != "")
           or handler.proc.poll() is not None)
    assert handler.proc.poll() is None, (tmp_path / "rank.err").read_text()
    worker = int(ready.read_text())
    assert _stat(worker, 1) == str(srv.proc.pid), \
        f"the rank was not forked warm: {(tmp_path / 'rank.err').read_text()}"
    return handler, worker


def _ended(handler, timeout: float = WAIT_S) -> int:
    """The rank's status once it ended by itself after torchrun's TERM (the liveness bound stands
    for torchrun's KILL, which this test never sends)."""
    try:
        return handler.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        handler.proc.kill()
        raise AssertionError(f"the rank did not end within {timeout:g} s of torchrun's TERM: "
                             "it waited for torchrun's KILL") from None


def test_a_frozen_rank_is_killed_soon_after_torchruns_term_and_not_journaled(srv, tmp_path):
    run = tmp_path / "run"
    script = _script(tmp_path, _rank("os.kill(os.getpid(), signal.SIGSTOP)\n"))
    handler, worker = _torchrun_starts(srv, script, tmp_path, SLURMFT_RUN_DIR=str(run),
                                       SLURM_JOB_ID="77", RANK="1")
    wait_until("the worker stopped", lambda: _state(worker) == "T")
    handler.close(death_sig=signal.SIGTERM)          # torchrun's _stop_workers: TERM, then 30 s
    # No KILL from torchrun comes here: the old client waited for it for ever (this bound).
    assert _ended(handler) == -signal.SIGKILL
    wait_until("the worker gone", lambda: _state(worker) is None)
    err = (tmp_path / "rank.err").read_text()
    assert f"worker {worker} stopped (state T)" in err and "after torchrun's TERM: killed" in err
    # torchrun's stop, not a crash: the server journals no rank_exit for it
    assert not (run / "events.jsonl").exists() or "rank_exit" not in (run / "events.jsonl").read_text()


def test_a_rank_that_does_not_end_after_torchruns_term_is_killed_after_the_grace(srv, tmp_path):
    script = _script(tmp_path, _rank("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # e.g. a hang holding the GIL
        while True:
            time.sleep(0.05)
    """))
    handler, worker = _torchrun_starts(srv, script, tmp_path, SLURMFT_WARM_STOP_GRACE_S="2")
    handler.close(death_sig=signal.SIGTERM)
    assert _ended(handler) == -signal.SIGKILL
    assert "still running (state" in (tmp_path / "rank.err").read_text()


SAVES = _rank("""
    got = []
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
    release = sys.argv[1] + ".release"
    while not os.path.exists(release):      # the emergency save, as long as it takes
        time.sleep(0.05)
    print(json.dumps(got), flush=True)
    sys.exit(85)
""")


def _keeps_running(worker: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _state(worker) in (None, "Z"):
            return False
        time.sleep(0.1)
    return True


def test_a_preempted_rank_keeps_its_save_window_after_torchruns_term(srv, tmp_path):
    """In-allocation preemption reaches the ranks as USR2 (the launcher's forward): a TERM from
    torchrun after it (a peer that saved and left first starts a restart round) is not a stop
    that may cut the save."""
    script = _script(tmp_path, SAVES)
    handler, worker = _torchrun_starts(srv, script, tmp_path, SLURMFT_WARM_STOP_GRACE_S="1")
    os.killpg(handler.proc.pid, signal.SIGUSR2)
    handler.close(death_sig=signal.SIGTERM)
    assert _keeps_running(worker, 4.0)     # the grace was 1 s: it would have been killed
    Path(f"{tmp_path / 'ready'}.release").write_text("")
    assert _ended(handler) == 85
    assert "killed" not in (tmp_path / "rank.err").read_text()


def test_a_rank_on_a_node_being_stopped_keeps_torchruns_bound(srv, tmp_path):
    """The node's task passed Slurm's TERM on to torchrun (it marked the node stopping first):
    even a stopped rank is left to torchrun's own bound."""
    script = _script(tmp_path, SAVES)
    handler, worker = _torchrun_starts(srv, script, tmp_path, SLURMFT_WARM_STOP_GRACE_S="1")
    warmtask.mark_stopping(srv.path)
    try:
        os.kill(worker, signal.SIGSTOP)
        wait_until("the worker stopped", lambda: _state(worker) == "T")
        handler.close(death_sig=signal.SIGTERM)
        assert _keeps_running(worker, 4.0)
        os.kill(worker, signal.SIGCONT)
        Path(f"{tmp_path / 'ready'}.release").write_text("")
        assert _ended(handler) == 85
    finally:
        os.unlink(warmclient.stopping_marker(srv.path))


@pytest.mark.parametrize("to_server", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_term_to_the_whole_step_leaves_the_ranks_to_save(tmp_path, to_server):
    """Slurm's TERM (a preemption, scancel) reaches every process of the step: the server too.
    It forks no more, but its ranks save and end as they decide (it used to kill them at once:
    the client then said it lost the server and exited 1). An INT or HUP reaching the server
    (``scancel --signal``, srun's Ctrl-C) is the same stop (an INT used to unwind it and kill
    every worker)."""
    server = Srv("json")
    try:
        script = _script(tmp_path, SAVES)
        handler, worker = _torchrun_starts(server, script, tmp_path)
        os.kill(server.proc.pid, to_server)
        for pid in (handler.proc.pid, worker):
            os.kill(pid, signal.SIGTERM)
        assert _keeps_running(worker, 2.0)
        Path(f"{tmp_path / 'ready'}.release").write_text("")
        assert _ended(handler) == 85
        assert "SIGTERM" in json.loads((tmp_path / "rank.out").read_text())   # it saw the TERM
        assert server.proc.wait(timeout=WAIT_S) == 0   # then it ends by itself
    finally:
        log = server.stop()
    assert "waiting for 1 to end" in log


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_stop_grace_names_the_variable(value):
    with pytest.raises(warm.WarmSettingsError, match=f"SLURMFT_WARM_STOP_GRACE_S='{value}'"):
        warm.settings({"SLURMFT_WARM_STOP_GRACE_S": value})
    assert warmclient.stop_grace_s({"SLURMFT_WARM_STOP_GRACE_S": "2.5"}) == 2.5
    assert warmclient.stop_grace_s({}) == warmclient.STOP_GRACE_S


def test_the_stop_rule_step_by_step(tmp_path):
    """``StopWatch`` alone, on a clock of its own: what each relayed signal and state leads to."""
    marker = str(tmp_path / "stopping")
    w = warmclient.StopWatch(marker, grace_s=15.0)
    assert w.due(0.0, "T") is None                       # no TERM yet: nothing to decide
    w.signalled(signal.SIGTERM, 10.0)
    assert w.due(10.5, "T") is None                      # stopped, not yet for STOPPED_CONFIRM_S
    assert w.due(10.75, "S") is None                     # it ran again: the count starts over
    assert w.due(11.4, "T") is None and w.due(11.6, "T") is None
    assert "stopped (state T) 1.7 s after" in w.due(11.65, "T")
    assert w.due(30.0, "Z") is None and w.due(30.0, None) is None   # it ended: the server reaps it
    g = warmclient.StopWatch(marker, grace_s=15.0)
    g.signalled(signal.SIGTERM, 0.0)
    g.signalled(signal.SIGTERM, 5.0)                     # a second TERM does not restart the grace
    assert g.due(14.9, "S") is None
    assert "still running (state S) 15.0 s after torchrun's TERM" in g.due(15.0, "S")
    for held in (signal.SIGUSR2, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        h = warmclient.StopWatch(marker, grace_s=1.0)
        h.signalled(held, 0.0)                           # before or after the TERM alike
        h.signalled(signal.SIGTERM, 1.0)
        assert h.due(100.0, "T") is None and signal.Signals(held).name in h.held
    m = warmclient.StopWatch(marker, grace_s=1.0)
    m.signalled(signal.SIGTERM, 0.0)
    Path(marker).write_text("")                          # the task marked the node stopping
    assert m.due(100.0, "T") is None and m.held == "the node is stopping"
