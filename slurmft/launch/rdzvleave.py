"""In-allocation mode: a fenced node's torchrun agent leaves the rendezvous at once and never
joins it again.

The launcher fences a node that still runs (Slurm drained it, a spare found it unfit): the node's
ranks leave on the new generation (``slurmft.train.alloc_watch``) and its agent, like every agent
whose workers ended, goes to torchrun's next round. Joining it, the agent formed a world with the
survivors that every rank left again at once (a node of it fenced); killed there by the launcher,
it stayed a participant of the finished round until its keep-alive expired (interval x attempts,
6 s at the defaults), and torch's c10d rendezvous opens the next round only once every
participant of the last one left it. The spare waited all that while: a failing health check cost
13.3 s from the drain to training again in the soak of 2026-11-28 (a node death ~9 s), the fenced
agent re-joining twice on the way.

So the agent of a node the launcher names in ``LEAVE_ENV`` looks at ``allocation.json`` before
each round (``DynamicRendezvousHandler.next_rendezvous``): once the record of this job lists its
node as fenced, it stops its keep-alive, removes itself from the participants (torch's own exit
operation, the one each of its rounds starts with, bounded by ``LEAVE_TIMEOUT_S``) and ends with
``FENCED_EXIT`` without joining: torchrun's workers are already stopped there, and it ends as on
a death signal, which leaves the rendezvous open (any other error closes it, ending every
agent). The launcher gives such a node ``LEAVE_GRACE_S`` before it kills its step. A dead node
cannot leave: its keep-alive's expiry stays on that path.

The hook uses torch's private rendezvous internals (torch 2.13): where they are missing the agent
still ends without joining, and its entry expires as before (said in its log). The record is untrusted
(``slurmft.allocation``): one that cannot be read is no fence.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from slurmft import allocation
from slurmft.rundir import RunDir

LEAVE_ENV = "SLURMFT_LEAVE_IF_FENCED"   # the node's name, set by the launcher on its step
RUN_DIR_ENV = "SLURMFT_RUN_DIR"
FENCED_EXIT = 89      # the agent's status when it left because its node was fenced
LEAVE_TIMEOUT_S = 5.0
LEAVE_GRACE_S = 10.0  # the launcher's wait for a live fenced node's step to end by itself


def is_fenced_end(exc: BaseException) -> bool:
    """``exc`` is the hook's: the agent left because its node was fenced."""
    return bool(getattr(exc, "slurmft_fenced", False))


def _job_ids(env: Mapping[str, str]) -> set[str]:
    return {v for v in (env.get("SLURMFT_JOB_ID"), env.get("SLURM_JOB_ID")) if v}


def is_fenced(run_dir: Path, node: str, job_ids: set[str]) -> bool:
    """The run's allocation record, of this job, lists ``node`` as fenced."""
    try:
        record = allocation.read(RunDir(run_dir))
    except allocation.AllocationError:
        return False
    return record is not None and record.for_job(job_ids) and node in record.fenced_nodes


def leave(handler: Any, log: Callable[[str], None]) -> str:
    """Stop ``handler``'s keep-alive and remove its node from the rendezvous' participants;
    what was done, in words."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
        handler._stop_heartbeats()
        handler._op_executor.run(dr._RendezvousExitOp(), time.monotonic() + LEAVE_TIMEOUT_S)
    except Exception as exc:   # torch's internals moved, or the store is gone: it expires
        log(f"could not leave the rendezvous ({type(exc).__name__}: {exc}); its keep-alive "
            "expires instead")
        return "not left"
    return "left the rendezvous"


def install(env: Mapping[str, str], log: Callable[[str], None] | None = None) -> bool:
    """Hook the elastic agent's next round for the node ``env[LEAVE_ENV]`` names (nothing
    without it or the run dir); True when hooked."""
    node, run_dir = env.get(LEAVE_ENV), env.get(RUN_DIR_ENV)
    if not node or not run_dir:
        return False
    say = log or (lambda text: print(f"slurmft agent: {text}", file=sys.stderr, flush=True))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    handler_cls = dr.DynamicRendezvousHandler
    original = handler_cls.next_rendezvous
    if getattr(original, "_slurmft_leave", False):
        return True
    ids = _job_ids(env)

    def next_rendezvous(self):
        if is_fenced(Path(run_dir), node, ids):
            done = leave(self, say)
            say(f"{node} is fenced by the launcher: {done}, not joining another round")
            # As a death signal: torchrun then stops its workers and keeps the rendezvous open
            # (any other exception closes it, and every agent with it).
            end = SignalException(f"{node} is fenced", signal.SIGTERM)
            end.slurmft_fenced = True  # type: ignore[attr-defined]
            raise end
        return original(self)

    next_rendezvous._slurmft_leave = True  # type: ignore[attr-defined]
    handler_cls.next_rendezvous = next_rendezvous   # type: ignore[method-assign]
    return True
