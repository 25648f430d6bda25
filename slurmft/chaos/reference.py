"""The uninterrupted run a chaos run is compared with: the same training script and arguments on
N local ranks (``torchrun --standalone``, no Slurm). A timeout, an error or a Ctrl-C kills every
process of the run, not only torchrun: torchrun starts each worker in a session of its own, and a
warm rank is forked by the server into one of its own too, so none of them is in torchrun's
process group; every process whose environment carries the run's own mark is killed.

Its ranks are forked warm as a job's are (``slurmft.launch.warm``: torchrun's agent imports
torch once and forks the server, which forks the ranks), unless the environment says
``SLURMFT_WARM_WORKERS=0`` or no server directory can be made: started cold, each rank imported
torch and the script's modules again (~4 CPU-s a rank). Warm or cold, the losses are the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Mapping

from slurmft.journal import Event, read_events
from slurmft.launch import agent, warm, warmfork, warmtask
from slurmft.launch.warmclient import SOCKET_ENV
from slurmft.rundir import RUN_DIR_ENV, RunDir
from slurmft.slurm.devcluster.procs import read_environ, snapshot

KILL_WAIT_S = 30
MARK_ENV = "SLURMFT_REFERENCE_RUN"   # every process of one run inherits it: how they are all found
LOG_TAIL = 3000                      # characters of the run's log in its error


class ReferenceRunError(RuntimeError):
    """The reference run failed or timed out (the message says which, with its log's end)."""


def uninterrupted_run(run_dir: Path, script: Path, args: list[str], ranks: int, *,
                      env: Mapping[str, str], timeout: float) -> list[Event]:
    """Train ``script args`` on ``ranks`` local ranks into ``run_dir``; its journal's events."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    full_env.update(env)
    full_env[RUN_DIR_ENV] = str(run_dir)
    full_env[MARK_ENV] = mark = uuid.uuid4().hex
    log = run_dir.parent / f"{run_dir.name}.log"
    command = [str(script), *args]
    server, cold = _warm_dir(full_env)
    if server is not None:
        full_env[SOCKET_ENV] = full_env[warmfork.SERVE_ENV] = server[0]
        command = ["--no-python", *warm.worker_command(command)]
    try:
        with open(log, "wb") as out:
            if cold:
                out.write(f"slurmft reference run: ranks started cold: {cold}\n".encode())
                out.flush()
            proc = subprocess.Popen([*agent.argv(), "--standalone", f"--nproc-per-node={ranks}",
                                     *command],
                                    env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                raise ReferenceRunError(f"the uninterrupted run did not finish within {timeout:.0f} s "
                                        f"(log: {log})") from None
            finally:  # a timeout, or an interrupt while waiting: no rank may outlive the wait
                if proc.poll() is None:
                    _kill_run(proc, mark)
    finally:
        if server is not None:   # torchrun's agent stopped the server it forked
            warmtask.release(*server)
    if code != 0:
        tail = log.read_text(errors="replace").strip()[-LOG_TAIL:]
        raise ReferenceRunError(f"the uninterrupted run exited {code} (log: {log}): {tail}")
    return read_events(RunDir(run_dir).events)


def _warm_dir(env: Mapping[str, str]) -> tuple[tuple[str, int | None] | None, str]:
    """The warm server's directory (its socket, the hold on it), or None and why the ranks start
    cold instead (``SLURMFT_WARM_WORKERS=0``, no directory); a bad setting is an error."""
    try:
        asked, _ = warm.settings(env)
    except warm.WarmSettingsError as exc:
        raise ReferenceRunError(str(exc)) from None
    if asked is False:
        return None, f"{warm.ENABLE_ENV}=0"
    try:
        return warmtask.make_dir(env), ""
    except OSError as exc:
        return None, f"no warm server directory: {exc}"


def _marked(mark: str) -> list[int]:
    """The live processes whose environment carries ``mark``: the agent, the warm server, the
    clients and every rank, warm (its environment is the server's) or cold."""
    me = os.getpid()
    return [st.pid for st in snapshot()
            if st.pid != me and st.state != "Z" and read_environ(st.pid).get(MARK_ENV) == mark]


def _kill_run(proc: subprocess.Popen, mark: str) -> None:
    """SIGKILL torchrun's group and every process of the run, again until none is left (a client
    whose server died as it asked may start its rank cold after the first pass), bounded."""
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        left = _marked(mark)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not left or time.monotonic() > deadline:
            break   # past the bound: a process stuck in the kernel, nothing more to do from here
        time.sleep(0.2)
    try:
        proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
