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
bounds the wait.

A dead node cannot leave by itself, and torch opens the next round only once its participant
entry expired (keep-alive interval x attempts after its last keep-alive: 4-6 s after the death at
the default silence bound, up to ~1.7 s after the fence). So the others drop a fenced node's
entries as torch drops an expired one: each agent publishes its identity in
the rendezvous' store under its node's name (``DESC_KEY``, once per handler, before its first
round), and every read of the rendezvous state (``_BackendRendezvousStateHolder._sanitize``,
torch's own place for dead nodes) takes the fenced nodes' out of its participants, wait list,
redundancy list and keep-alives, with torch's own epilogue (the round reopens once no participant
is left). ``allocation.json`` is read there only while some node's keep-alive in the state is
older than the interval and a second (a dead or fenced node's; torch's own expiry removes such an
entry at the latest, so the reads stop); a node that published nothing is left to its expiry. The
hook never raises: whatever fails in it, the entry expires as before. Measured (node
deaths with a spare on the devcluster, ``benchmarks/inalloc_phases_bench.py``): the round that
takes the spare in completed 0.79-1.04 s after the fence (7 trials), 0.93-1.01 s before (4): at
the default bound the expiry seldom came later than the rest of the round (the survivors leaving
the last one and all joining the next, each one compare-and-set of the whole state, racing each
other), so what it removes is the tail when it does (in-process, torch's rendezvous alone, the
dead entry held the round 0.75-0.99 s after a fence 4.8 s after the death, 0.38-0.44 s dropped).

Private torch internals (2.13) are used: where they are missing the agent does not hook and
torchrun's rendezvous is unchanged.

It lives in ``slurmft.train`` because it touches torch (only inside ``install``, which the agent
(``slurmft.launch.agent``) calls); the launcher reads its names, torch-free.
"""

from __future__ import annotations

import signal
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from slurmft import allocation
from slurmft.rundir import RunDir

LEAVE_ENV = "SLURMFT_LEAVE_IF_FENCED"   # the node's name, set by the launcher on its step
RUN_DIR_ENV = "SLURMFT_RUN_DIR"
LEAVE_TIMEOUT_S = 5.0
LEAVE_GRACE_S = 10.0  # the launcher's wait for a live fenced node's step to end by itself
DESC_KEY = "slurmft.rdzv_node/{run_id}/{node}"   # a node's rendezvous identity, in the store
# A live node's keep-alive can be an interval and ~1 s old (``nodesteps``): only an older one
# makes a reader look for fences.
STALE_MARGIN = timedelta(seconds=1)


class _FencedInRound(Exception):
    """Raised inside torch's join loop: the node was fenced while it waited in a round."""


def is_fenced_end(exc: BaseException) -> bool:
    """``exc`` is the hook's: the agent left because its node was fenced."""
    return bool(getattr(exc, "slurmft_fenced", False))


def is_fenced(run_dir: Path, node: str, ids: set[str]) -> bool:
    """The run's allocation record, of this job, lists ``node`` as fenced."""
    return node in fenced_nodes(run_dir, ids)


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


def publish(handler: Any, node: str) -> None:
    """Put ``handler``'s identity (torch's node descriptor: address, pid, local id) in the
    rendezvous' store under ``node``'s name, for the others to drop it once it is fenced."""
    desc = handler._this_node
    handler._store.set(DESC_KEY.format(run_id=handler._settings.run_id, node=node),
                       f"{desc.addr}|{desc.pid}|{desc.local_id}")


def published(store: Any, run_id: str, node: str, dr: Any) -> Any:
    """The descriptor ``node``'s agent published for the rendezvous ``run_id``, or None (none yet,
    or not one: only an equal descriptor's entries are ever dropped)."""
    key = DESC_KEY.format(run_id=run_id, node=node)
    try:
        if not store.check([key]):
            return None
        addr, pid, local_id = store.get(key).decode().rsplit("|", 2)
        return dr._NodeDesc(addr, int(pid), int(local_id))
    except (ValueError, UnicodeDecodeError, RuntimeError):
        return None


def drop(state: Any, desc: Any, settings: Any, dr: Any) -> None:
    """Take ``desc`` out of ``state`` as torch's ``_sanitize`` takes an expired node out (its
    epilogue: a finished round with no participant left reopens)."""
    state.last_heartbeats.pop(desc, None)
    state.wait_list.discard(desc)
    state.redundancy_list.discard(desc)
    if state.participants.pop(desc, None) is not None:
        dr._remove_participant_epilogue(state, settings)


def fenced_nodes(run_dir: Path, ids: set[str]) -> tuple[str, ...]:
    """The nodes the run's allocation record, of this job, names as fenced (a record that cannot
    be read or does not check is no fence, as for ``is_fenced``)."""
    try:
        record = allocation.read(RunDir(run_dir))
    except allocation.AllocationError:
        return ()
    return tuple(record.fenced_nodes) if record is not None and record.for_job(ids) else ()


def _drop_fenced_on_read(dr: Any, node: str, fenced: Callable[[], tuple[str, ...]]) -> bool:
    """Hook every read of the rendezvous state: the fenced nodes' entries dropped (see above)."""
    holder_cls: Any = getattr(dr, "_BackendRendezvousStateHolder", None)
    sanitize = getattr(holder_cls, "_sanitize", None)
    if sanitize is None or getattr(dr, "_remove_participant_epilogue", None) is None \
            or getattr(dr, "_NodeDesc", None) is None:
        return False
    descs: dict[tuple[str, str], Any] = {}   # (run id, node) -> its published descriptor

    def sanitize_and_drop_fenced(self):
        sanitize(self)
        try:
            state, settings = self._state, self._settings
            stale = datetime.now(timezone.utc) - settings.keep_alive_interval - STALE_MARGIN
            if not any(beat < stale for beat in state.last_heartbeats.values()):
                return
            store = getattr(self._backend, "_store", None)
            for other in fenced():
                if other == node or store is None:
                    continue
                key = (settings.run_id, other)
                if key not in descs:
                    desc = published(store, settings.run_id, other, dr)
                    if desc is None:
                        continue
                    descs[key] = desc
                drop(state, descs[key], settings, dr)
        except Exception:   # noqa: BLE001 - never torch's keep-alive thread or a round: it expires
            return

    holder_cls._sanitize = sanitize_and_drop_fenced
    return True


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
    shown: set[int] = set()  # the handlers (ids) whose identity is published

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
        if id(self) not in shown:
            try:
                publish(self, node)
                shown.add(id(self))
            except Exception as exc:   # noqa: BLE001 - the store: its entry then expires instead
                say(f"could not publish {node}'s rendezvous identity ({type(exc).__name__}: "
                    f"{exc}): once fenced, its entry expires instead of being dropped")
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
    if not _drop_fenced_on_read(dr, node, lambda: fenced_nodes(where, ids)):
        say("torch's rendezvous has moved (no _BackendRendezvousStateHolder._sanitize): a dead "
            "fenced node's entry expires instead of being dropped at the fence")
    return True
