"""The uninterrupted run a chaos run is compared with: the same training script and arguments on
N local ranks (``torchrun --standalone``, no Slurm), in its own process group so that a timeout,
an error or a Ctrl-C kills every rank, not only torchrun.

Its ranks are forked warm as a job's are (``slurmft.launch.warm``: torchrun's agent imports
torch once and forks the server, which forks the ranks), unless the environment says
``SLURMFT_WARM_WORKERS=0`` or no server directory can be made: started cold, each rank imported
torch and the script's modules again (~4 CPU-s a rank). Warm or cold, the losses are the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Mapping

from slurmft.journal import Event, read_events
from slurmft.launch import agent, warm, warmfork, warmtask
from slurmft.launch.warmclient import SOCKET_ENV
from slurmft.rundir import RUN_DIR_ENV, RunDir

KILL_WAIT_S = 30


class ReferenceRunError(RuntimeError):
    """The reference run failed or timed out (the message says which, with its stderr's end)."""


def uninterrupted_run(run_dir: Path, script: Path, args: list[str], ranks: int, *,
                      env: Mapping[str, str], timeout: float) -> list[Event]:
    """Train ``script args`` on ``ranks`` local ranks into ``run_dir``; its journal's events."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    full_env.update(env)
    full_env[RUN_DIR_ENV] = str(run_dir)
    log = run_dir.parent / f"{run_dir.name}.log"
    command = [str(script), *args]
    server = _warm_dir(full_env)
    if server is not None:
        full_env[SOCKET_ENV] = full_env[warmfork.SERVE_ENV] = server[0]
        command = ["--no-python", *warm.worker_command(command)]
    try:
        with open(log, "wb") as out:
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
                    _kill_group(proc)
    finally:
        if server is not None:   # torchrun's agent stopped the server it forked
            warmtask.release(*server)
    if code != 0:
        tail = log.read_text(errors="replace").strip()[-800:]
        raise ReferenceRunError(f"the uninterrupted run exited {code} (log: {log}): {tail}")
    return read_events(RunDir(run_dir).events)


def _warm_dir(env: Mapping[str, str]) -> tuple[str, int | None] | None:
    """The warm server's directory (its socket, the hold on it), or None: ranks started cold."""
    if env.get(warm.ENABLE_ENV) == "0":
        return None
    try:
        return warmtask.make_dir(env)
    except OSError:
        return None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass  # a rank stuck in the kernel: nothing more can be done from here
