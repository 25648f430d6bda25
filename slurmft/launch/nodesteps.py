"""In-allocation mode's launch shape: one ``srun`` step per node (active and spare alike), each
running that node's task (``slurmft.launch.task``) around an elastic torchrun.

  srun --nodes=1 --ntasks=1 --nodelist=NODE --kill-on-bad-exit=0 ...
       python -m slurmft.launch.task python -m slurmft.launch.agent --nnodes=MIN:ACTIVE
       --rdzv-conf=is_host=0|1,keep_alive_interval=I,keep_alive_max_attempt=A,last_call_timeout=L
       --max-restarts=R ...

A node's death ends only its own step. torchrun's c10d store lives with the batch host's agent
(``is_host=1`` there only); the agents of the other nodes reach it over TCP. A spare's step is
started with the others, but its task starts torchrun only once ``allocation.json`` makes the
spare active (``spare``): its agent then joins the round that follows the fence, which completes
as soon as ACTIVE nodes are in (no last call), and with fewer (a shrink) ``last_call_timeout``
after MIN joined.

The agents' keep-alive expiry (interval x attempts) is the launcher's own
``SLURMFT_NODE_SILENT_S`` rounded up to whole intervals: torchrun cannot close a round while a
dead participant is in it, so the expiry was on a node death's critical path, and it needs no
margin past the launcher's fence (since 2026-11-28 the other agents drop a dead node's entry once
the launcher fenced it, ``rdzv_leave``: the expiry is on that path only where that cannot be
done). It is three intervals of a third of the bound (2 s x 3 at the default 5 s), not 1 s x the
bound: every state change of torch's c10d rendezvous is one
compare-and-set of the whole state, and a node waiting in a round writes its keep-alive every
interval; the agent whose join completes the round must read, change and write the state
between two of those writes. On a loaded node (0.3-0.9 s from its read to its write) with two
others writing every second, it lost that race 23 times in a row and the round took 18.8 s, not
2.5 s (devcluster, load 14: ``benchmarks/recovery_bench.py``; the spare recoveries of 16.7-74.7 s
before). Three attempts, not two: a live node's keep-alive can be interval + ~1 s old when its
join returns (torch refreshes it once per loop of its join, after the interval passed), and its
next one comes an interval later (the agent's timer): at 3 s x 2 live agents were dropped from
the rendezvous as dead 3 s after a round (devcluster, torch's debug log). So the expiry is at
least 2 intervals + 2 s (four attempts at a 1 s interval).
torchrun may re-form without the dead node just before the launcher fences it (a shrink, whose
round needs no newcomer); the ranks of that world leave on a new generation only when it fences
a node of their world or re-forms it on other nodes (``slurmft.train.alloc_watch``), so the
fence that follows does not end them again.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from slurmft.launch import agent, procs, warm
from slurmft.launch.alloc_settings import AllocSettings
from slurmft.launch.rendezvous import Rendezvous
from slurmft.launch.settings import LaunchSettings
from slurmft.launch.task import ALIVE_ENV
from slurmft.rundir import RunDir

LAST_CALL_S = 3                 # a shrunk world's round completes this long after MIN joined
MAX_RESTARTS = 1000             # torchrun's own bound: the launcher's progress rule decides
# How often an agent looks at its ranks and at the rendezvous (torch's own default): a rank's
# exit, or another agent's new round, is seen this long after on the critical path of every
# recovery in the allocation (0.5 s before 2026-11-28: 0.25 s on average, twice in a row for a
# crash on another node). A look is a waitpid per rank, and a read of the store at most once per
# ``rdzv_poll`` poll.
MONITOR_S = 0.1


def keep_alive(node_silent_s: float) -> tuple[int, int]:
    """torchrun's keep-alive (interval s, attempts): a third of the silence bound rounded up to
    whole seconds (torch reads an int), three times; four at a 1 s interval (see above)."""
    interval = int(math.ceil(node_silent_s / 3))
    return interval, (4 if interval == 1 else 3)


def rdzv_conf(is_host: bool, alloc: AllocSettings) -> str:
    interval, attempts = keep_alive(alloc.node_silent_s)
    return (f"--rdzv-conf=is_host={int(is_host)},keep_alive_interval={interval},"
            f"keep_alive_max_attempt={attempts},last_call_timeout={LAST_CALL_S}")


def node_argv(node: str, rdzv: Rendezvous, alloc: AllocSettings, settings: LaunchSettings,
              command: Sequence[str], python: str = sys.executable,
              job_id: str | None = None) -> list[str]:
    """One node's step: its task around an elastic torchrun (``rdzv.host`` hosts the store); in
    the allocation of the spare job ``job_id`` when given (``refill``)."""
    return ["srun", *([f"--jobid={job_id}"] if job_id else []), "--nodes=1", "--ntasks=1",
            f"--nodelist={node}", "--kill-on-bad-exit=0",
            "--job-name=slurmft-train", python, "-m", "slurmft.launch.task",
            *agent.argv(python),
            f"--nnodes={alloc.min_nodes}:{len(alloc.active)}",
            f"--nproc-per-node={settings.nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.rdzv_id}",
            rdzv_conf(node == rdzv.host, alloc), f"--max-restarts={MAX_RESTARTS}",
            f"--monitor-interval={MONITOR_S}",
            *(["--no-python", *warm.worker_command(command, python)] if settings.warm_workers
              else command)]


@dataclass
class NodeStep:
    node: str
    proc: subprocess.Popen
    started: float          # monotonic
    rc: int | None = None   # srun's exit status once reaped (128+N: signal N)

    def poll(self) -> int | None:
        if self.rc is None:
            rc = self.proc.poll()
            if rc is not None:
                self.rc = rc if rc >= 0 else 128 - rc
        return self.rc


# torchrun shares its rendezvous store with the ranks' bootstrap by default, and an agent keeps
# the first round's master address for ever: after a round whose rank 0 is another node (the
# old one dead) its ranks dial a dead store until timeout (seen on the devcluster, torch 2.13).
# Unshared, every round's rank 0 publishes a fresh address and port.
STEP_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def start(node: str, argv: Sequence[str], env: Mapping[str, str], run_dir: RunDir,
          extra_env: Mapping[str, str] | None = None) -> NodeStep:
    step_env = {**env, **STEP_ENV, **(extra_env or {}), ALIVE_ENV: str(run_dir.alive(node))}
    run_dir.alive(node).parent.mkdir(parents=True, exist_ok=True)
    return NodeStep(node, procs.start(argv, step_env), time.monotonic())
