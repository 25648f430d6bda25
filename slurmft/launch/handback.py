"""The fenced nodes' step KILLs through Slurm, and before a requeue from the allocation the lost
nodes handed back to Slurm.

Under ``--no-kill`` a requeued job stays COMPLETING until every node of it has ended it, and a
node whose slurmd is dead never does: Slurm waits until it calls the node DOWN, SlurmdTimeout
after its last answer (devcluster, a node killed with no spare left: 21 s of a 46 s recovery at
SlurmdTimeout 10, 127 s of 149 s at 120; real clusters default to 300). Taken out of the job
first (``scontrol update JobId=J NodeList=<the others>``, which the job's owner may do), the
requeue ends in under a second.

Only a node Slurm no longer schedules is released (NOT_RESPONDING, DOWN, DRAIN, FAIL): a dead
node it still thinks up would be handed to the next job in the queue (seen on the devcluster,
with no ExcNodeList: the requeued job itself started on it). Slurm flags a dead node
NOT_RESPONDING once a message to it fails (here the KILL of its step sent at the fence: 10-21 s
after it on the devcluster, or a ping's: up to 2/3 x SlurmdTimeout; DOWN at SlurmdTimeout
counts too), so the launcher waits for that flag, bounded by ``WAIT_S``, for a node whose step
KILL got no answer (the controller was trying a dead slurmd) or has none yet; not for one Slurm
delivered it to (its slurmd answers: the job ends there at once), nor for one whose KILL Slurm
refused or that had none (its step had ended by itself: no evidence; released only if Slurm
flags it already: a task killed on a live node must not cost the wait).
Whatever fails here, the requeue goes on as before: this only shortens it.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from typing import Callable, Sequence

from slurmft.slurm.client import Node, NodeState, OutcomeUnknown, SlurmError

# What became of the KILL sent through Slurm to a fenced node's step (``StepKills.reached``).
DELIVERED = "delivered"  # Slurm signalled the step: the node's slurmd answers
FAILED = "failed"        # no answer in the client's 10 s: the controller was trying a dead slurmd
PENDING = "pending"      # under way (the controller answers a dead node's only after 10 s+)
REFUSED = "refused"      # Slurm said no (the step gone...): no evidence about the node
UNSENT = "unsent"        # none sent (the step had ended by itself): no evidence either way
NO_EVIDENCE = (REFUSED, UNSENT)


class StepKills:
    """The KILLs sent through Slurm to fenced nodes' steps (``scancel --signal=KILL JOB.STEP``,
    each in a thread), and whether Slurm could deliver each."""

    def __init__(self, client, job_id: str, log: Callable[[str], None]) -> None:
        self.client, self.job_id, self.log = client, job_id, log
        self._threads: dict[str, threading.Thread] = {}
        self._done: dict[str, str] = {}

    def send(self, node: str, step_id: str) -> None:
        thread = threading.Thread(target=self._kill, args=(node, step_id), daemon=True,
                                  name=f"slurmft-kill-{node}")
        self._threads[node] = thread
        thread.start()

    def _kill(self, node: str, step_id: str) -> None:
        try:
            self.client.signal_step(self.job_id, step_id, "KILL")
            self._done[node] = DELIVERED
        except OutcomeUnknown as exc:
            self._done[node] = FAILED
            self.log(f"WARNING: could not kill step {step_id} on {node} through Slurm: {exc}")
        except SlurmError as exc:
            self._done[node] = REFUSED
            self.log(f"WARNING: could not kill step {step_id} on {node} through Slurm: {exc}")

    def reached(self, node: str) -> str:
        """DELIVERED, FAILED, PENDING, REFUSED or UNSENT: what became of the KILL of ``node``'s
        step."""
        if node in self._done:
            return self._done[node]
        thread = self._threads.get(node)
        return PENDING if thread is not None and thread.is_alive() else UNSENT


# For Slurm to flag a dead node: NOT_RESPONDING once a message to it failed (a ping, sent to a
# node silent SlurmdTimeout/3, comes up to 2/3 x SlurmdTimeout after the death), DOWN at
# SlurmdTimeout; 330 s covers the default 300 s. For a dead node the wait never ends later than
# the requeue's COMPLETING would have (that ended at DOWN); past it the requeue goes on as before.
WAIT_S = 330.0
POLL_S = 2.0  # a node query per job every 2 s: a rack's failure must not flood the controller


def unschedulable(node: Node) -> bool:
    """Slurm will not start a job on it: not responding, DOWN, drained or failing."""
    return (not node.responding or node.state is NodeState.DOWN or node.drained
            or "FAIL" in node.flags or "FAILING" in node.flags)


# The wait ends this long before the job's time limit at the latest: the template's USR2 comes
# 120 s before it (which ends the wait too), and the requeue must go out before Slurm's TERM.
END_MARGIN_S = 150.0


def wait_bound(client, job_id: str, now: datetime | None = None) -> float:
    """``WAIT_S``, or less when the job's time limit comes sooner (its end less ``END_MARGIN_S``;
    0 when that has passed). ``WAIT_S`` when the job cannot be read or has no limit."""
    try:
        end = client.job(job_id).time_limit_end
    except SlurmError:
        return WAIT_S
    if end is None:
        return WAIT_S
    end = end if end.tzinfo else end.replace(tzinfo=timezone.utc)
    left = (end - (now or datetime.now(timezone.utc))).total_seconds() - END_MARGIN_S
    return max(0.0, min(WAIT_S, left))


def release_lost(client, job_id: str, nodes: Sequence[str], reached: Callable[[str], str],
                 log: Callable[[str], None], *, wait_s: float = WAIT_S, poll_s: float = POLL_S,
                 stop: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Release from ``job_id`` those of ``nodes`` whose slurmd is gone, once Slurm flags them;
    return the nodes released. ``reached(node)``: what became of its step's KILL (``StepKills``):
    a DELIVERED one is left alone; a FAILED or PENDING one is waited for (``wait_s``, and only
    while ``stop()`` is false: a signal to the job, its time limit near, ends the wait at once);
    a REFUSED or UNSENT one (no evidence either way) is released only if Slurm flags it already."""
    if client is None or not nodes:
        return []
    deadline = clock() + wait_s
    while True:
        waiting = [n for n in nodes if reached(n) != DELIVERED]
        if not waiting:
            return []
        try:
            states = client.nodes(list(waiting))
        except SlurmError as exc:
            log(f"WARNING: could not read the state of {','.join(waiting)}: {exc}; the requeue "
                "waits on Slurm to end the job there")
            return []
        flagged = [n for n in waiting if n in states and unschedulable(states[n])]
        late = [n for n in waiting if n not in flagged]
        if all(reached(n) in NO_EVIDENCE for n in late) or clock() >= deadline:
            break
        if stop():
            log(f"a signal came while waiting for Slurm to flag {','.join(late)}: the requeue "
                "goes out now (it waits on Slurm to end the job there)")
            break
        sleep(poll_s)
    if late:
        log(f"{','.join(late)} not flagged by Slurm"
            + (f" after {wait_s:g} s" if any(reached(n) not in NO_EVIDENCE for n in late) else "")
            + ": left in the job (the requeue waits on Slurm to end the job there)")
    if not flagged:
        return []
    try:
        client.release_nodes(job_id, flagged)
    except SlurmError as exc:
        log(f"WARNING: could not release {','.join(flagged)} from the job: {exc}; the requeue "
            "waits on Slurm to end the job there")
        return []
    log(f"released {','.join(flagged)} from the job (Slurm flagged it "
        f"{'/'.join(sorted(_flags(states[n]) for n in flagged))}): the requeue need not wait "
        "for SlurmdTimeout")
    return flagged


def _flags(node: Node) -> str:
    return ",".join([node.state.value, *sorted(node.flags)])
