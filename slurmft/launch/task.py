"""``python -m slurmft.launch.task TORCHRUN_ARGV...``: one node's task of the training step.

torchrun dies on SIGUSR2's default action and orphans its ranks, so it is started with USR2
ignored; the ranks install their own handler (``slurmft.train.preemption``). The task stays
torchrun's parent and relays each USR2 it gets to torchrun's workers (``relay``): under
``proctrack/pgid`` Slurm signals only the task's process group, and the workers run in sessions
of their own. It exits as torchrun did (its code, or killed by its signal). Slurm's TERM or INT
reaches torchrun itself (it is in the task's process group, which every proctrack plugin
signals): the task only outlives it, to pass torchrun's status on. The node that hosts
the rendezvous store (node 0 of the step) says so with ``--rdzv-conf=is_host=1``; in
in-allocation mode the launcher writes each node's ``--rdzv-conf`` itself (every node is node 0
of its own one-node step).

In in-allocation mode (``SLURMFT_ALIVE_FILE`` set by the launcher) the task stays torchrun's
parent and beats: every ``ALIVE_PERIOD_S`` it replaces that file (node, Slurm step id, a
sequence number) from a thread that no collective can block, so the launcher tells a dead or
frozen node (no beat) from a node whose ranks wait on a dead peer (beats go on); from another
thread it beats over TCP to the launcher too (``beatsend``: a stalled shared filesystem blocks
only the file's thread). TERM and INT
are passed to torchrun, which stops its workers; the task exits with torchrun's status. On the
other nodes than the batch host it also watches the batch host's beat (``orphan``): the batch
host dead, it requeues the job (Slurm keeps a ``--no-kill`` job running without its batch script).
When torchrun's workers are warm clients (the launcher's decision, in both modes: warm workers
are on unless ``SLURMFT_WARM_WORKERS=0``) the task makes the node's warm server's directory and
tells torchrun's agent to fork the server there (``warmfork``; the agent stops it at its end),
and removes the directory when torchrun ends; when a TERM or INT comes (passed on to torchrun,
or Slurm's to torchrun too) it marks the node stopping (``warmtask.mark_stopping``), so that the
clients leave that stop's ranks to torchrun's own bound instead of killing a frozen one early
(``warmclient.StopWatch``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from slurmft import allocation
from slurmft.launch import beatsend, orphan, relay, spare, warm, warmfork, warmtask
from slurmft.launch.warmclient import SOCKET_ENV
from slurmft.rundir import atomic_write_json

ALIVE_ENV = "SLURMFT_ALIVE_FILE"
# Set by the launcher on a step it starts in a spare job's allocation (``refill``): Slurm gives
# the task the spare job's id, and the training job's is put back (``adopt_main_job``).
AS_JOB_ENV = "SLURMFT_STEP_FOR_JOB"
AS_RESTART_ENV = "SLURMFT_STEP_FOR_RESTART_COUNT"
AS_PREFIX = "SLURMFT_STEP_FOR_"
# The training job's own words on its allocation, put back as they were in the launcher's
# environment (a release that sets them for the step's job would name the spare job's one node).
ADOPTED = ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")
ALIVE_PERIOD_S = 1.0
ALIVE_VERSION = 1


def argv_for_node(argv: list[str], node_id: str | None) -> list[str]:
    if any(a.startswith("--rdzv-conf") for a in argv):
        return list(argv)
    is_host = "1" if node_id == "0" else "0"
    return [*argv[:3], f"--rdzv-conf=is_host={is_host}", *argv[3:]]


def write_beat(path: Path, seq: int, ended: int | None = None) -> None:
    beat = {"version": ALIVE_VERSION, "node": os.environ.get("SLURMD_NODENAME", ""),
            "step_id": os.environ.get("SLURM_STEP_ID", ""), "seq": seq, "pid": os.getpid(),
            "time": time.time()}
    if ended is not None:
        beat["ended"] = ended
    try:
        atomic_write_json(path, beat)
    except OSError as exc:
        print(f"slurmft.launch.task: cannot write {path}: {exc}", file=sys.stderr, flush=True)


def beat_forever(path: Path, stop: threading.Event, period_s: float = ALIVE_PERIOD_S) -> int:
    """Replace ``path`` every ``period_s`` until ``stop``; a failed write is retried next time
    (the launcher fences a node only after many missed beats). Returns the last sequence number."""
    seq = 0
    while True:
        seq += 1
        write_beat(path, seq)
        if stop.wait(period_s):
            return seq


def _warm_dir(argv: list[str]) -> tuple[str, int | None] | None:
    """This node's warm server's directory when torchrun's workers are its clients: torchrun's
    agent forks the server there (``warmfork``)."""
    try:
        if warm.serves(argv):
            return warmtask.make_dir(os.environ)
    except OSError as exc:   # the clients then run their ranks cold
        print(f"slurmft.launch.task: no warm server: {exc}", file=sys.stderr, flush=True)
    return None


def _torchrun_env(server: tuple[str, int | None] | None) -> dict[str, str] | None:
    if server is None:
        return None
    return {**os.environ, SOCKET_ENV: server[0], warmfork.SERVE_ENV: server[0]}


def supervise(argv: list[str], alive: Path) -> int:
    """Run torchrun as a child while beating; return its exit status (128+N for signal N). A
    spare's task (``spare.SPARE_ENV``) starts torchrun only once the launcher made it active."""
    sender = beatsend.take_from(os.environ)  # first: nothing started below sees the token
    server = _warm_dir(argv)
    env = _torchrun_env(server)
    stop, stopping = threading.Event(), threading.Event()
    child: list[subprocess.Popen] = []

    def forward(signum: int, frame: object) -> None:
        stopping.set()
        if server is not None:   # first: the ranks this stop reaches keep torchrun's bound
            warmtask.mark_stopping(server[0])
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    beater = threading.Thread(target=beat_forever, args=(alive, stop), daemon=True,
                              name="slurmft-alive")
    beater.start()
    net = None if sender is None else threading.Thread(
        target=sender.run, args=(stop, ALIVE_PERIOD_S), daemon=True, name="slurmft-alive-tcp")
    if net is not None:
        net.start()
    watch = orphan.from_environ(os.environ, None if sender is None else sender.acked)
    if watch is not None:  # not the batch host: requeue the job if the batch host dies

        def lost(silent_s: float) -> None:
            conn = "" if sender is None else f" ({sender.status})"
            orphan.requeue_job(os.environ, silent_s, watch.describe() + conn)
            forward(signal.SIGTERM, None)

        threading.Thread(target=orphan.watch_forever, args=(watch, stop, lost), daemon=True,
                         name="slurmft-batch-watch").start()
    rc = 0
    restore = None
    try:
        node = spare.waiting_node(os.environ)
        run_dir = os.environ.get("SLURMFT_RUN_DIR")
        if node is None or run_dir is None:
            child.append(subprocess.Popen(argv, env=env))  # inherits USR2 ignored
        else:   # a spare: torchrun waits, imported, until the launcher makes this node active
            ready, active = spare.ReadyTorchrun.start(argv, env), False
            try:
                active = spare.wait_until_active(Path(run_dir), node, allocation.job_ids(os.environ),
                                                 stopping)
            finally:
                if ready is not None and not active:
                    ready.cancel()
            if active:
                child.append(ready.go(env) if ready is not None else subprocess.Popen(argv, env=env))
        if child:
            restore = relay.install(lambda: None if child[0].returncode is not None else child[0].pid)
            if stopping.is_set():  # a TERM that came as it started
                child[0].send_signal(signal.SIGTERM)
            rc = child[0].wait()
    finally:
        if restore is not None:
            restore()
        stop.set()
        if server is not None:   # torchrun's agent stopped the server it forked
            warmtask.release(*server)
    beater.join(timeout=5 * ALIVE_PERIOD_S)
    rc = rc if rc >= 0 else 128 - rc
    # The last beat says the task ended by itself: its node is alive (not a node death).
    if sender is not None and net is not None:
        net.join(timeout=2 * beatsend.CONNECT_S + ALIVE_PERIOD_S)
        if not net.is_alive():
            sender.finish(rc)
    write_beat(alive, 1 << 40, ended=rc)
    return rc


def exit_like(status: int) -> None:
    """Exit as a child ended: its code, or killed by its signal (``Popen.returncode``)."""
    if status >= 0:
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        signal.signal(-status, signal.SIG_DFL)
    except (OSError, ValueError):   # SIGKILL and SIGSTOP cannot be caught: already the default
        pass
    os.kill(os.getpid(), -status)
    time.sleep(1.0)   # a signal whose default action is not to end (never torchrun's end)
    os._exit(128 - status)


def run_torchrun(argv: list[str]) -> int:
    """torchrun as a child, USR2 relayed to its workers; its ``Popen.returncode``."""

    early: list[int] = []  # a signal that came before torchrun existed to get it too
    server = _warm_dir(argv)

    def outlive(signum: int, frame: object) -> None:
        # torchrun got the same signal: it stops its workers and ends; we pass its status on
        if server is not None:   # a real stop: its ranks keep torchrun's bound to save
            warmtask.mark_stopping(server[0])
        early.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, outlive)   # reset to the default in torchrun at its exec
    try:
        child = subprocess.Popen(argv, env=_torchrun_env(server))   # inherits USR2 ignored
        if early:  # it came before the Popen (a step cancelled as it starts): torchrun never heard it
            child.send_signal(early[0])
        restore = relay.install(lambda: None if child.returncode is not None else child.pid)
        try:
            return child.wait()
        finally:
            restore()
    finally:
        if server is not None:   # torchrun's agent stopped the server it forked
            warmtask.release(*server)


def adopt_main_job(env) -> None:
    """In a step of a spare job's allocation: the training job's id and restart count where Slurm
    put the spare job's, for this task and everything it starts (the ranks journal them)."""
    job = env.get(AS_JOB_ENV)
    if not job:
        return
    env["SLURM_JOB_ID"] = env["SLURM_JOBID"] = job
    env["SLURM_RESTART_COUNT"] = env.get(AS_RESTART_ENV) or "0"
    for name in ADOPTED:
        value = env.get(AS_PREFIX + name)
        if value:
            env[name] = value
        else:
            env.pop(name, None)


def main() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    adopt_main_job(os.environ)
    argv = sys.argv[1:]
    if len(argv) < 3:
        sys.exit("slurmft.launch.task: expected PYTHON -m slurmft.launch.agent TORCHRUN_ARGS...")
    full = argv_for_node(argv, os.environ.get("SLURM_NODEID"))
    alive = os.environ.get(ALIVE_ENV)
    if alive:
        sys.exit(supervise(full, Path(alive)))
    exit_like(run_torchrun(full))


if __name__ == "__main__":
    main()
