"""In-allocation mode: a fenced node's torchrun agent leaves the rendezvous at once and never
joins it again.

The launcher fences a node that still runs (Slurm drained it, an admin's drain came due): the
node's ranks leave on the new generation (``slurmft.train.alloc_watch``) and its agent, like every
agent whose workers ended, goes to torchrun's next round. Joining it, the agent formed a world with
the survivors that every rank left again at once (a node of it fenced); killed there by the
launcher, it stayed a participant of the finished round until its keep-alive expired (interval x
attempts, 6 s at the defaults), and torch's c10d rendezvous opens the next round only once every
participant of the last one left it. The spare waited all that while: a failing health check cost
13.3 s from the drain to training again in the soak of 2026-11-28 (a node death ~9 s), the fenced
agent re-joining twice on the way.

So the agent of a node the launcher names in ``LEAVE_ENV`` looks at ``allocation.json`` (of this
job; untrusted: one that cannot be read is no fence) wherever it touches the rendezvous: before a
round (``DynamicRendezvousHandler.next_rendezvous``), at each read while it waits in one (the join
operation), and instead of each keep-alive (its timer thread, so that an agent whose workers do
not stop, a rank in D state on a sick node, leaves all the same). Once its node is fenced it
leaves: out of the participants, the wait list and the redundancy list (torch's own actions, one
compare-and-set each), no keep-alive after it. The first two then end the agent with
``exitcodes.FENCED`` without joining: as on a death signal, which keeps the rendezvous open (any
other error closes it, ending every agent; torch logs it as a SIGTERM received). torchrun's
workers are stopped before any round. The launcher kills such a node's step only
``LEAVE_GRACE_S`` after the fence, unless the step ended with ``FENCED`` first: that grace, not
``LEAVE_TIMEOUT_S`` (checked between store operations, each of which can wait on a dead store),
bounds the wait. A dead node cannot leave: its keep-alive's expiry stays on that path.

Private torch internals (2.13) are used: where they are missing the agent does not hook and
torchrun's rendezvous is unchanged.

It lives in ``slurmft.train`` because it touches torch (only inside ``install``, which the agent
(``slurmft.launch.agent``) calls); the launcher reads its names, torch-free.
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
LEAVE_TIMEOUT_S = 5.0
LEAVE_GRACE_S = 10.0  # the launcher's wait for a live fenced node's step to end by itself


class _FencedInRound(Exception):
    """Raised inside torch's join loop: the node was fenced while it waited in a round."""


def is_fenced_end(exc: BaseException) -> bool:
    """``exc`` is the hook's: the agent left because its node was fenced."""
    return bool(getattr(exc, "slurmft_fenced", False))


def is_fenced(run_dir: Path, node: str, ids: set[str]) -> bool:
    """The run's allocation record, of this job, lists ``node`` as fenced."""
    try:
        record = allocation.read(RunDir(run_dir))
    except allocation.AllocationError:
        return False
    return record is not None and record.for_job(ids) and node in record.fenced_nodes


def _leave_op(dr: Any) -> Callable[[Any, float], Any]:
    """A rendezvous operation (torch's protocol: a state -> the next action) that takes the node
    out of the participants, the wait list and the redundancy list."""
    action = dr._Action

    def op(ctx: Any, deadline: float) -> Any:
        state = ctx.state
        inside = ctx.node in state.participants or ctx.node in state.wait_list \
            or ctx.node in state.redundancy_list
        if inside and time.monotonic() > deadline:
            return action.ERROR_TIMEOUT
        if ctx.node in state.participants:
            return action.REMOVE_FROM_PARTICIPANTS
        if ctx.node in state.wait_list:
            return action.REMOVE_FROM_WAIT_LIST
        if ctx.node in state.redundancy_list:
            return action.REMOVE_FROM_REDUNDANCY_LIST
        return action.FINISH
    return op


def leave(handler: Any, dr: Any, log: Callable[[str], None]) -> str:
    """Take ``handler``'s node out of the rendezvous; what was done, in words. The caller stops
    its keep-alive timer (or is that timer)."""
    try:
        handler._op_executor.run(_leave_op(dr), time.monotonic() + LEAVE_TIMEOUT_S)
    except Exception as exc:   # the store is gone or the state moved on: its entry expires
        log(f"could not leave the rendezvous ({type(exc).__name__}: {exc}); its keep-alive "
            "expires instead")
        return "not left"
    return "left the rendezvous"


def install(env: Mapping[str, str], log: Callable[[str], None] | None = None) -> bool:
    """Hook torch's rendezvous for the node ``env[LEAVE_ENV]`` names (nothing without it or the
    run dir, or without torch's internals); True when hooked."""
    node, run_dir = env.get(LEAVE_ENV), env.get(RUN_DIR_ENV)
    if not node or not run_dir:
        return False
    say = log or (lambda text: print(f"slurmft agent: {text}", file=sys.stderr, flush=True))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    handler_cls = dr.DynamicRendezvousHandler
    join_cls: Any = getattr(dr, "_RendezvousJoinOp", None)
    needed = (getattr(dr, "_Action", None), join_cls, getattr(handler_cls, "_keep_alive", None))
    if any(x is None for x in needed):
        say("torch's rendezvous has moved (no _Action, _RendezvousJoinOp or _keep_alive): a "
            "fenced node's agent does not leave it by itself")
        return False
    original = handler_cls.next_rendezvous
    if getattr(original, "_slurmft_leave", False):
        return True
    ids, where = allocation.job_ids(env), Path(run_dir)
    left: set[int] = set()   # the handlers (ids) that left: one leave each

    def fenced() -> bool:
        return is_fenced(where, node, ids)

    def leave_once(handler: Any) -> str:
        if id(handler) in left:
            return "left the rendezvous"
        done = leave(handler, dr, say)
        left.add(id(handler))
        return done

    def end(handler: Any, when: str) -> None:
        handler._stop_heartbeats()
        say(f"{node} is fenced by the launcher ({when}): {leave_once(handler)}, not joining "
            "another round (torchrun logs this end as a SIGTERM)")
        # As a death signal: torchrun then keeps the rendezvous open.
        stop = SignalException(f"{node} is fenced", signal.SIGTERM)
        stop.slurmft_fenced = True  # type: ignore[attr-defined]
        raise stop

    def next_rendezvous(self):
        if fenced():
            end(self, "before a round")
        try:
            return original(self)
        except _FencedInRound:
            end(self, "in a round")

    join_call = join_cls.__call__

    def join(self, ctx, deadline):
        if fenced():
            raise _FencedInRound()
        return join_call(self, ctx, deadline)

    keep_alive = handler_cls._keep_alive

    def keep_alive_or_leave(self):
        if not fenced():
            return keep_alive(self)
        if id(self) not in left:   # the timer's thread, under torch's own lock for it
            with self._heartbeat_lock:
                done = leave_once(self)
            say(f"{node} is fenced by the launcher (at a keep-alive): {done}")
        return None

    next_rendezvous._slurmft_leave = True  # type: ignore[attr-defined]
    handler_cls.next_rendezvous = next_rendezvous   # type: ignore[method-assign]
    join_cls.__call__ = join                        # type: ignore[method-assign]
    handler_cls._keep_alive = keep_alive_or_leave   # type: ignore[method-assign]
    return True
