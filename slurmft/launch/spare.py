"""In-allocation mode: a hot spare's node task waits, started, until the launcher makes it active.

A spare's step starts with the job (srun, its python, the node's beat, its warm server when
asked for), but its torchrun only once ``<run_dir>/allocation.json`` lists this node among the
``active`` ones, which the launcher writes when it fences a node and gives the spare its place.
A spare that ran torchrun from the start would sit on the rendezvous' redundancy list and join
whenever the participants drop below ``max_nodes``: also while a healthy node's agent restarts
its ranks in place after a crash, so the spare and that agent race for its place, and the loser
left on the wait list restarts everyone again (seen in benchmarks/recovery_bench.py's rank crash,
never recovered in the allocation). The file is untrusted: one that cannot be read or checked
waits on (said once); one of another job is not this job's.

So that the activation does not pay torchrun's own start (``import torch`` in its agent: 5-15 s
on a loaded node), the waiting task starts torchrun at once, imported and stopped before its
``main`` (``ReadyTorchrun``, ``slurmft.launch.pretorchrun``), and lets it go on activation. It is
the task's child as a cold torchrun is: the task's signal forwarding, exit status and last beat
are the same; what torchrun sees (argv, environment, signals, exit) is what ``python -m
torch.distributed.run`` sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Mapping, Sequence

from slurmft import allocation
from slurmft.launch import agent, pretorchrun
from slurmft.rundir import RunDir

SPARE_ENV = "SLURMFT_SPARE_NODE"   # set by the launcher on a spare's step: the node's name
# A spare's look at the record is on a node death's critical path (the round that follows the
# fence completes when its agent joins): 0.05 s on average, where 0.5 s cost 0.25. A spare
# reads one small file ten times a second; a job has a few spares.
POLL_S = 0.1


def waiting_node(env: Mapping[str, str]) -> str | None:
    return env.get(SPARE_ENV) or None


def wait_until_active(run_dir: Path, node: str, job_ids: set[str], stop: threading.Event,
                      poll_s: float = POLL_S) -> bool:
    """Until ``node`` is active in the run's allocation (True) or ``stop`` is set (False)."""
    warned = False
    while True:
        try:
            alloc = allocation.read(RunDir(run_dir))
        except allocation.AllocationError as exc:
            alloc = None
            if not warned:
                print(f"slurmft.launch.task: spare {node} waits on: {exc}", file=sys.stderr, flush=True)
                warned = True
        if alloc is not None and alloc.for_job(job_ids) and node in alloc.active:
            return True
        if stop.wait(poll_s):
            return False


CANCEL_WAIT_S = 10.0


class ReadyTorchrun:
    """torchrun started ahead, imported, waiting for ``go`` (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen, go_fd: int, argv: Sequence[str]) -> None:
        self.proc, self._go_fd, self.argv = proc, go_fd, list(argv)

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str] | None) -> "ReadyTorchrun | None":
        """Start ``argv`` (the agent's: ``PYTHON -m slurmft.launch.agent ARGS``) up to torchrun's
        ``main``; None for another command (started cold on activation) or when it cannot be
        started."""
        if not agent.is_agent(argv):
            return None
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen([argv[0], "-m", "slurmft.launch.pretorchrun", "--go-fd",
                                     str(read_fd), "--", *argv[3:]], env=env, pass_fds=(read_fd,))
        except OSError as exc:
            os.close(write_fd)
            print(f"slurmft.launch.task: torchrun not started ahead ({exc}): it starts cold on "
                  "activation", file=sys.stderr, flush=True)
            return None
        finally:
            os.close(read_fd)
        return cls(proc, write_fd, argv)

    def go(self, env: Mapping[str, str] | None) -> subprocess.Popen:
        """Let it run torchrun's ``main``; one that died meanwhile is replaced by a cold start."""
        try:
            if self.proc.poll() is None:
                os.write(self._go_fd, pretorchrun.GO)
                return self.proc
        except OSError:   # it died between the poll and the write
            pass
        finally:
            os.close(self._go_fd)
        self.proc.wait()
        print(f"slurmft.launch.task: the torchrun started ahead ended ({self.proc.returncode}) "
              "before activation: starting it cold", file=sys.stderr, flush=True)
        return subprocess.Popen(self.argv, env=env)

    def cancel(self) -> None:
        """Never activated: it ends having run nothing (EOF on its pipe; TERM while it imports)."""
        os.close(self._go_fd)
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=CANCEL_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=CANCEL_WAIT_S)
