"""The node task relays USR2 to torchrun's workers (slurmft.launch.relay): a preemption reaches
the ranks whatever Slurm's proctrack plugin.

A real process tree, no Slurm: in-allocation mode's ``python -m slurmft.launch.task`` in a
session of its own (as slurmstepd starts a task in its own process group) around a real torchrun
whose two gloo ranks (tests/helpers/trap_worker.py) are forked by the task's warm server and stood
for by warm clients. Then USR2 as slurmstepd delivers it: ``proctrack/pgid`` signals only the
task's process group; cgroup and linuxproc every process of the step (each worker then hears it
from Slurm, from its client and through the relay). Both: the ranks agree, save one emergency
checkpoint and end with 85 (requeue me). The plain launch (cold ranks, the task around torchrun
without beats) under a real ``proctrack/pgid`` Slurm: tests/integration/test_launch_jobs.py's job
without scontrol.

Every wait is bounded and every process of the tree is killed (by pid) before the test returns.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from procs import alive, json_lines, wait_until
from slurmft import exitcodes
from slurmft.journal import read_events
from slurmft.launch import agent, nodesteps, relay, task, warm
from slurmft.rundir import RunDir, read_done

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "trap_worker.py"
PY = sys.executable
STEPS = 3000          # 0.1 s each: far more than any bound below, so only a signal ends the run


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def test_process_groups_are_the_descendants_outside_ours(tmp_path):
    """Only ``root``'s descendants, only groups other than ours: a grandchild in its child's new
    session counts once, a child left in our group does not, nor does anything outside."""
    tree = subprocess.Popen([PY, "-c", (
        "import subprocess, sys, time\n"
        "a = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "b = subprocess.Popen(['sh', '-c', 'sleep 60 & sleep 60; wait'], start_new_session=True)\n"
        "c = subprocess.Popen(['sleep', '60'])\n"
        "print(a.pid, b.pid, c.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, start_new_session=True)
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        a, b, c = map(int, tree.stdout.readline().split())
        wait_until("the tree's grandchildren", lambda: len(_descendants(tree.pid)) >= 5, 30)
        assert relay.process_groups(tree.pid, own_pgid=tree.pid) == {a, b}
        assert c not in relay.process_groups(tree.pid, own_pgid=tree.pid)
        members = [p for p in _descendants(tree.pid) if os.getpgid(p) in (a, b)]
        assert len(members) == 4   # a; b (sh) and its two sleeps
        assert relay.relay(tree.pid, signal.SIGTERM, own_pgid=tree.pid) == sorted([a, b])
        wait_until("the relayed groups to end", lambda: not any(map(alive, members)), 30)
        assert alive(c) and alive(tree.pid) and stranger.poll() is None
    finally:
        for pid in [*_descendants(tree.pid), tree.pid, stranger.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        tree.wait(timeout=30)
        stranger.wait(timeout=30)


def _task_argv(run_dir: Path, out: Path) -> list[str]:
    """The node step's command in in-allocation mode (nodesteps), one node, no restart."""
    rank = [str(WORKER), "--run-dir", str(run_dir), "--out", str(out), "--loop", "clean",
            "--steps", str(STEPS), "--ckpt-every", "1000", "--sleep", "0.1", "--lr", "0.001"]
    return [PY, "-m", "slurmft.launch.task", *agent.argv(PY), "--standalone",
            "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.5", "--no-python",
            *warm.worker_command(rank)]


def _deliver(how: str, task_pid: int) -> None:
    if how == "pgid":   # proctrack/pgid: killpg(the task's process group)
        os.killpg(task_pid, signal.SIGUSR2)
        return
    for pid in [task_pid, *_descendants(task_pid)]:   # cgroup, linuxproc: every process
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["pgid", "every"])
def test_usr2_to_the_task_reaches_every_warm_rank_which_saves_once(tmp_path, how):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURMFT_RUN_DIR", "SLURM_PROCID",
                        "SLURM_NTASKS", "SLURMFT_WARM_WORKERS")}
    env.update(OMP_NUM_THREADS="1", SLURM_JOB_ID="79", SLURM_NODEID="0", SLURM_STEP_ID="0")
    sock_dir = Path(f"/tmp/relay-{os.getpid()}-{tmp_path.name}"[:60])   # the warm server's socket
    sock_dir.mkdir()
    env.update(nodesteps.STEP_ENV, TMPDIR=str(sock_dir),   # in-allocation mode: the task beats
               **{task.ALIVE_ENV: str(RunDir(run_dir).alive("n1"))})
    RunDir(run_dir).alive("n1").parent.mkdir(parents=True)
    proc = subprocess.Popen(_task_argv(run_dir, out), env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "task.err", "wb"),
                            start_new_session=True)   # as slurmstepd: the task leads its group
    tree: list[int] = []
    try:
        ranks = [Path(f"{out}.rank{r}") for r in range(2)]
        wait_until("both ranks to train 3 steps", lambda: all(len(json_lines(p)) >= 4 for p in ranks), 180, poll=0.2)
        pids = [json_lines(p)[0]["pid"] for p in ranks]
        assert all(os.getpgid(pid) != proc.pid for pid in pids)   # in sessions of their own
        tree = _descendants(proc.pid)
        _deliver(how, proc.pid)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("the task (torchrun) did not end within 120 s of USR2 to the "
                                 f"task's process group ({how}): the ranks never heard it") from None
    finally:
        for pid in [*tree, *_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert rc == 1, (rc, (tmp_path / "task.err").read_text()[-2000:])  # torchrun: a worker failed
    events = RunDir(run_dir).events
    (preempted,) = read_events(events, ["preemption"])   # one agreement, one emergency save
    assert preempted.get("signal") == "SIGUSR2", preempted.fields
    step = preempted.get("step")
    assert step < STEPS and read_done(RunDir(run_dir)) is None
    committed = [e.get("step") for e in read_events(events, ["checkpoint_committed"])]
    assert committed == [step], committed
    ends = read_events(events, ["segment_end"])
    assert [e.get("exit_code") for e in ends] == [exitcodes.REQUEUE], [e.fields for e in ends]


def test_the_task_ends_as_torchrun_did_also_when_torchrun_was_killed_by_sigkill():
    """The task is torchrun's parent, not its exec: a torchrun killed -9 (the OOM killer, an
    admin) must end the task killed -9 too, not exit 1 with a traceback (SIGKILL's disposition
    cannot be set)."""
    code = "from slurmft.launch import task; task.exit_like(task.run_torchrun(['sh', '-c', 'kill -9 $$']))"
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "Traceback" not in done.stderr


def test_a_term_that_comes_before_torchrun_is_started_still_ends_it():
    """The step cancelled as the task starts: the TERM lands after the task set its handler but
    before torchrun exists. torchrun must get it too (before, the task swallowed it and torchrun
    trained on until Slurm's KILL); the task ends as torchrun did."""
    code = ("import os, signal, subprocess; from slurmft.launch import task\n"
            "popen = subprocess.Popen\n"
            "def late(*args, **kwargs):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return popen(*args, **kwargs)\n"
            "subprocess.Popen = late\n"
            "task.exit_like(task.run_torchrun(['sleep', '30']))\n")
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr


def test_a_relay_that_cannot_read_proc_costs_the_relay_not_the_task(tmp_path):
    """USR2 while /proc cannot be listed: one line names it; the task still waits for torchrun and
    passes its status on (before, the exception left the handler and ended the task mid-wait)."""
    code = (f"import os, signal, threading; from pathlib import Path; from slurmft.launch import relay, task\n"
            f"relay.process_groups.__defaults__ = (Path({str(tmp_path / 'no-proc')!r}),)\n"
            f"signal.signal(signal.SIGUSR2, signal.SIG_IGN)\n"
            f"threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGUSR2)).start()\n"
            f"task.exit_like(task.run_torchrun(['sh', '-c', 'sleep 2; exit 7']))\n")
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    assert "could not pass signal" in done.stderr and "no-proc" in done.stderr
