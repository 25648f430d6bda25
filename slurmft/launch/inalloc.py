"""In-allocation mode: the launcher supervises one training step per node and recovers from a
node's death inside the allocation, without Slurm.

  open the TCP beat listener (``beatnet``) -> start every node's step (``nodesteps``; a spare's
  task waits, started, without torchrun until ``allocation.json`` makes it active: ``spare``)
  -> every ``POLL_S``: forward signals, read the nodes' beats on both channels (``liveness``),
  reap ended steps -> a node silent for ``SLURMFT_NODE_SILENT_S`` on both channels, or whose step ended without training having ended,
  is fenced: ``allocation.json`` gets the new generation first (the ranks exit on it), then the
  journal's ``fault_detected``/``recovery_action`` (``"where": "allocation"``), then its step is
  killed (its srun here, its tasks through ``scancel --signal=KILL JOB.STEP``); a live active
  node's only once its agent left torchrun's rendezvous (``rdzv_leave``) or after
  ``LEAVE_GRACE_S``. An active node
  is replaced by the first spare (same world: bit-identical) or, without one, dropped (the
  world shrinks) while at least ``SLURMFT_MIN_NODES`` remain; below that, and when the batch
  host's own step fails (it holds the rendezvous store), the job goes the requeue path (85).
  A node Slurm shows DOWN, DRAIN or FAIL (``nodestate``, polled every ~10 s off the loop: the
  sweeper's failing health check, an admin's drain) is fenced the same way while its task still
  beats: an active node other than the batch host is replaced or dropped, a spare is dropped;
  the batch host's is left to the requeue path (the watcher acts on it), warned about once.
With ``SLURMFT_SPARE_REFILL=1`` (``refill``) fewer spares waiting than the job started with is
made up from outside the allocation: a one-node spare job asked of Slurm, whose node, once it
runs, gets its step started in that job's allocation and waits as a spare like the others; such
a node is fenced by cancelling its spare job, and every spare job is cancelled at the end.

What ends the loop is the training's own end: every active step ended after the ranks recorded
their segment's outcome (or exited 0); the spares are then stopped and ``main`` decides the exit
code from the recorded outcome exactly as for the default launch shape.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from slurmft import allocation as record
from slurmft import exitcodes, journal, steppoint
from slurmft.launch import allocation as alloc_mod
from slurmft.launch import beatnet, handback, nodesteps, nodestate, orphan, refill
from slurmft.launch import spare as spare_task
from slurmft.launch.inplace import InPlace, ProcessFaults
from slurmft.launch.alloc_settings import AllocSettings
from slurmft.launch.identity import JobIdentity
from slurmft.launch.journaling import Voice
from slurmft.launch import liveness
from slurmft.launch.liveness import Liveness
from slurmft.launch.rendezvous import Rendezvous
from slurmft.launch.settings import LaunchSettings
from slurmft.launch.signals import SignalLog
from slurmft.rundir import RunDir
from slurmft.train import rdzv_leave, rdzv_poll

POLL_S = 0.5
STARTUP_S = 120.0        # srun + python + the first beat of a node's task on a loaded node
STOP_KILL_AFTER_S = 10.0
# After the ranks recorded a preempted or do-not-requeue end (85, 86, their emergency save
# committed first), the steps are stopped at once: torchrun never ends by itself on a failed
# worker, it starts the ranks again, and with warm workers such a world trained and saved a
# second emergency checkpoint within the 5 s this grace once was (seen under load, 2026-11-27).
END_GRACE_S = 0.0
DONE_GRACE_S = 60.0       # a clean end (0): torchrun ends by itself, nothing restarts
END_KILL_AFTER_S = 40.0   # TERM -> KILL: torchrun's own stop of its workers takes up to 30 s
ENDED = (exitcodes.OK, exitcodes.REQUEUE, exitcodes.NO_REQUEUE)
WHERE = "allocation"
# The fences of a node that still runs, whose agent leaves torchrun's rendezvous by itself
# (``rdzv_leave``) when it beat this recently; a silent or DOWN node cannot.
LEAVING_CAUSES = (nodestate.NODE_UNHEALTHY, nodestate.NODE_DRAINED)
LEAVE_BEAT_S = 2.0


class GiveUp(Exception):
    """Running again would fail the same way (a crash loop): exit 86, the reason journaled."""


class GoRequeue(Exception):
    """The job cannot go on in its allocation: requeue it (excluding ``exclude``)."""

    def __init__(self, reason: str, exclude: Mapping[str, str]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exclude = dict(exclude)


@dataclass
class _Leaving:
    until: float               # monotonic: its step is killed then if it has not ended
    step_id: str | None
    holder: str | None         # its spare job (``refill``), cancelled with the kill
    rc: int | None = None      # its srun's exit status once it ended


@dataclass
class Fault:
    node: str
    cause: str                # node_death | node_silent | rank_crash
    evidence: list[str]


class Supervisor:
    def __init__(self, ident: JobIdentity, cfg: LaunchSettings, alloc: AllocSettings,
                 rdzv: Rendezvous, command: Sequence[str], env: Mapping[str, str],
                 signals: SignalLog, voice: Voice, client, on_signal: Callable[[str], None],
                 recorded: Callable[[], int | None]) -> None:
        self.ident, self.cfg, self.settings, self.rdzv = ident, cfg, alloc, rdzv
        self.command, self.env, self.signals, self.voice = command, env, signals, voice
        self.client, self.on_signal, self.recorded = client, on_signal, recorded
        self.run_dir = RunDir(cfg.run_dir)
        self.alloc = alloc_mod.initial(ident.slurm_id, alloc.active, alloc.spares, alloc.min_nodes)
        self.min_nodes = alloc.min_nodes
        self.liveness = Liveness(self.run_dir, startup_s=STARTUP_S, log=voice.log)
        self.steps: dict[str, nodesteps.NodeStep] = {}
        self.done: dict[str, int] = {}          # active node -> its step's exit status at the end
        self.ending = False
        self._end_at: float | None = None     # monotonic: when the remaining steps are stopped
        self._termed_at: float | None = None
        self._next_send: float | None = None
        self._started = time.monotonic()
        self.net: beatnet.Listener | None = None
        self.process_faults = ProcessFaults(self.run_dir.events, {ident.slurm_id, ident.raw_job_id}, ident.restart_count,
                                            lambda n, s: n in self.steps and self.liveness.silent_s(n) < s)
        self.node_states = nodestate.NodeStates(client, self._watched, voice.log,
                                                 poll_s=alloc.node_poll_s)
        self._warned_unfit: set[str] = set()
        self.kills = handback.StepKills(client, ident.slurm_id, voice.log)
        self._leaving: dict[str, _Leaving] = {}   # fenced live nodes whose agents leave first
        self.spares_wanted = len(alloc.spares)
        self.refill = refill.Refill(client, ident, self.run_dir, env, alloc.spare_sbatch, voice.log,
                                    batch_alive=self.run_dir.alive(rdzv.host),
                                    silent_s=alloc.node_silent_s) \
            if alloc.refill and client is not None else None
        if alloc.refill and client is None:
            voice.log("WARNING: SLURMFT_SPARE_REFILL=1 but no Slurm client in the job: no spare "
                      "jobs are asked for")

    # -- the loop ------------------------------------------------------------------------------

    def run(self, pending: Sequence[str] = ()) -> int:
        """Supervise to the training's end; return the steps' exit status (0, or the batch
        host's / first failed active node's). Raises GoRequeue."""
        self._publish()
        self._open_net()
        for node in (*self.alloc.active, *self.alloc.spares):
            self._start(node)
        for name in pending:
            self._signal(name)
        self.node_states.start()
        if self.refill is not None:
            self.refill.start()
        while True:
            for name in self.signals.take():
                self._signal(name)
            self._resend()
            self.liveness.poll()
            self._reap()
            self._end_leaving()
            if not self.ending:
                self._fence_found()
                self._refill()
                self._in_place()
                code = self.process_faults.ended
                if code is not None:
                    self._begin_end(f"the ranks recorded their end ({exitcodes.describe(code)})",
                                    DONE_GRACE_S if code == exitcodes.OK else END_GRACE_S)
            self._end_steps()
            if all(node in self.done for node in self.alloc.active):
                break
            time.sleep(POLL_S)
        self._stop_rest()
        rcs = [self.done[n] for n in self.alloc.active]
        return next((rc for rc in rcs if rc != 0), 0)

    def _start(self, node: str) -> None:
        holder = self.alloc.spare_job_of(node)
        argv = nodesteps.node_argv(node, self.rdzv, self.settings, self.cfg, self.command,
                                   job_id=holder)
        host = self.rdzv.host
        others = [n for n in self.ident.nodes if n != host]
        others += [j.node for j in self.alloc.spare_jobs if j.node]
        extra = {} if node == host else orphan.environ_for(
            host, self.run_dir.alive(host), self.settings.node_silent_s, others.index(node))
        if node in self.alloc.spares:
            extra[spare_task.SPARE_ENV] = node
        extra[rdzv_leave.LEAVE_ENV] = node
        extra[rdzv_poll.ENV] = str(rdzv_poll.poll_for(len(self.ident.nodes)))
        if self.net is not None:
            extra.update(self.net.environ_for(node))
        env = self.env
        if holder is not None:
            env = refill.step_env(self.env)
            extra.update(refill.step_environ(self.env, self.ident.raw_job_id, self.ident.restart_count))
        self.steps[node] = nodesteps.start(node, argv, env, self.run_dir, extra)
        self.liveness.expect(node)
        role = "spare" if node in self.alloc.spares else "active"
        where = f", in the spare job {holder}" if holder else ""
        self.voice.log(f"started the training step on {node} ({role}{where})")

    # -- spares from outside the allocation (``refill``) ---------------------------------------

    def _refill(self) -> None:
        if self.refill is None:
            return
        for ready in self.refill.take_ready():
            if len(self.alloc.spares) >= self.spares_wanted:   # not needed (any more)
                self.voice.log(f"the spare job {ready.job_id} on {ready.node} is not needed: cancelled")
                self.refill.cancel(ready.job_id)
            else:
                self._add_spare(ready)
        alloc = self.alloc
        self.refill.want(self.spares_wanted - len(alloc.spares),
                         sorted({*self.ident.nodes, *alloc.fenced_nodes,
                                 *(j.node for j in alloc.spare_jobs if j.node)}))
        # A queued spare job is listed at once (it ends by itself when it is not: ``sparehold``),
        # and no longer once it ended in the queue.
        pending = self.refill.pending()
        kept = tuple(j for j in alloc.spare_jobs if j.node or j.job_id in pending)
        listed = {j.job_id for j in kept}
        queued = [j for j in pending if j not in listed]
        if queued or len(kept) != len(alloc.spare_jobs):
            self.alloc = replace(alloc, spare_jobs=(*kept, *(record.SpareJob(j) for j in queued)))
            self._publish()

    def _add_spare(self, ready: refill.Ready) -> None:
        assert self.refill is not None
        alloc = self.alloc
        if ready.node in (*self.ident.nodes, *alloc.fenced_nodes) or ready.node in self.steps:
            self.voice.log(f"the spare job {ready.job_id}'s node {ready.node} cannot be a spare "
                           "of this job: cancelled")
            self.refill.cancel(ready.job_id)
            return
        jobs = tuple(j for j in alloc.spare_jobs if j.job_id != ready.job_id)
        self.alloc = replace(alloc, spares=(*alloc.spares, ready.node),
                             spare_jobs=(*jobs, record.SpareJob(ready.job_id, ready.node)))
        self._publish()
        if self.net is not None:
            self.net.admit(ready.node)
        self._start(ready.node)

    def _reap(self) -> None:
        for node, step in list(self.steps.items()):
            rc = step.poll()
            if rc is None:
                continue
            del self.steps[node]
            if node in self.alloc.fenced_nodes:
                if node in self._leaving:
                    self._leaving[node].rc = rc
                continue
            if not self.ending and (rc == 0 or self.recorded() in ENDED):
                self._begin_end(f"the step on {node} exited {rc}")
            if self.ending:
                if node in self.alloc.active:
                    self.done[node] = rc
                continue
            ended = self.liveness.ended(node)
            if node == self.rdzv.host:
                self._journal_fault(Fault(node, "rank_crash", [
                    f"the batch host's training step ended (srun exit {rc}): the rendezvous "
                    "store it held is gone"]))
                raise GoRequeue(f"the training step on the batch host {node} ended (srun exit "
                                f"{rc}) while training went on", {})
            if ended is not None:
                self.fence(Fault(node, "rank_crash", [f"its task ended by itself (torchrun exit "
                                                      f"{ended}, srun exit {rc})"]), reaped=True)
            else:
                self.fence(Fault(node, "node_death", [
                    f"its training step ended (srun exit {rc}) without its task ending: the task "
                    f"was killed (last beat {self.liveness.silent_s(node):.1f} s ago)"]), reaped=True)

    def _begin_end(self, why: str, grace_s: float = DONE_GRACE_S) -> None:
        self.ending = True
        self._end_at = time.monotonic() + grace_s
        self.voice.log(f"training is ending ({why})")

    def _end_steps(self) -> None:
        """Once the grace is over, TERM the active steps still running (srun passes it to the
        task, which passes it to torchrun), then KILL them."""
        if self._end_at is None or time.monotonic() < self._end_at:
            return
        running = [s for n, s in self.steps.items() if n in self.alloc.active and s.proc.poll() is None]
        if self._termed_at is None:
            self._termed_at = time.monotonic()
            for step in running:
                step.proc.send_signal(signal.SIGTERM)
            if running:
                self.voice.log(f"stopping the steps on {','.join(s.node for s in running)} "
                               "(torchrun would start the ranks again)")
        elif time.monotonic() - self._termed_at > END_KILL_AFTER_S:
            for step in running:
                try:
                    os.killpg(step.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _silent(self) -> list[Fault]:
        bound = self.settings.node_silent_s
        faults = []
        for node in self.steps:
            if node in self.alloc.fenced_nodes or not self.liveness.silent(node, bound):
                continue
            if node == self.rdzv.host:  # our own node, and we run: its task is stuck
                self.voice.log(f"WARNING: the batch host's task has not beaten for "
                               f"{self.liveness.silent_s(node):.0f} s")
                continue
            how = "since its last beat" if self.liveness.has_beaten(node) else \
                "since its step was started, without a first beat"
            faults.append(Fault(node, "node_silent", [
                f"no beat from its task for {self.liveness.silent_s(node):.1f} s {how}: "
                f"{self.liveness.describe(node)} (SLURMFT_NODE_SILENT_S={bound:g})"]))
        return faults

    def _fence_found(self) -> None:
        """Fence every node found silent or unfit this round (spares first: a spare that is
        itself unfit must not replace a node)."""
        for fault in (*self._unfit(), *self._silent()):
            if fault.node not in self.alloc.fenced_nodes:
                self.fence(fault)

    def _watched(self) -> list[str]:
        """The nodes whose Slurm state is polled (called from ``nodestate``'s thread)."""
        alloc = self.alloc
        return [n for n in (*alloc.active, *alloc.spares) if n not in alloc.fenced_nodes]

    def _unfit(self) -> list[Fault]:
        """The nodes Slurm says must not train (``nodestate``), but the batch host: its step
        holds the rendezvous store, so its trouble is the requeue path's (warned about once)."""
        alloc, faults = self.alloc, []
        order = [n for n in (*alloc.spares, *alloc.active) if n in self.steps and n not in alloc.fenced_nodes]
        for why in self.node_states.unfit(order, committed=self.process_faults.newest_commit, waits=alloc.active):
            if why.node != self.rdzv.host:
                faults.append(Fault(why.node, why.cause, [why.evidence]))
            elif why.node not in self._warned_unfit:
                self._warned_unfit.add(why.node)
                self.voice.log(f"WARNING: {why.evidence}: the batch host cannot be replaced inside "
                               "the allocation (it holds the rendezvous store); left to the requeue "
                               "path")
        return faults

    # -- restarts in place (torchrun's own) ----------------------------------------------------

    def _in_place(self) -> None:
        found, restarts = self.process_faults.poll()
        for fault in found:
            self.voice.event(journal.FAULT_DETECTED, where=WHERE, cause=fault.cause,
                             nodes=fault.nodes, evidence=fault.evidence, fault_time=fault.fault_time,
                             detected_by="launcher")
            self.voice.log(f"{fault.cause} on {','.join(fault.nodes) or 'a healthy node'}: "
                           f"{'; '.join(fault.evidence)} (torchrun restarts the ranks in place)")
        for fault in restarts:
            self._restarted(fault)

    def _restarted(self, fault: InPlace) -> None:
        in_a_row = self.process_faults.count_restart()
        limit = self.settings.alloc_restarts
        self.voice.event(journal.RECOVERY_ACTION, where=WHERE, action="restart_in_place",
                         nodes=fault.nodes, spare=None, world_nodes=len(self.alloc.active),
                         generation=self.alloc.generation, cause=fault.cause, ok=in_a_row <= limit)
        self.voice.log(f"the ranks restarted in place after a {fault.cause} ({in_a_row} in a row "
                       f"without a newer checkpoint; SLURMFT_ALLOC_RESTARTS={limit})")
        if in_a_row > limit:
            raise GiveUp(f"{in_a_row} restarts in place in a row without a newer checkpoint "
                         f"(SLURMFT_ALLOC_RESTARTS={limit}), the last after a {fault.cause}: "
                         f"{'; '.join(fault.evidence)}")

    # -- fencing -------------------------------------------------------------------------------

    def fence(self, fault: Fault, *, reaped: bool = False) -> None:
        node, alloc = fault.node, self.alloc
        was_active = node in alloc.active
        spare = alloc.spares[0] if was_active and alloc.spares else None
        self._journal_fault(fault)
        holder = alloc.spare_job_of(node)
        # A live active node's agent is a participant of torchrun's rendezvous: it leaves it by
        # itself (``rdzv_leave``) before its step is killed, or the next round waits for its
        # keep-alive to expire. A silent or DOWN node cannot (the other agents drop its entry once
        # it is fenced, ``rdzv_leave``); a spare's agent never joined.
        leaves = was_active and not reaped and fault.cause in LEAVING_CAUSES \
            and not self.liveness.silent(node, LEAVE_BEAT_S)
        if holder is not None and self.refill is not None:  # the node goes back to Slurm with its job
            if not leaves:
                self.refill.cancel(holder)
            if not was_active:
                self.refill.spoiled(holder)
        if was_active and spare is None and len(alloc.active) - 1 < self.min_nodes:
            if leaves and holder is not None and self.refill is not None:
                self.refill.cancel(holder)
            self._kill(node)
            raise GoRequeue(f"{node} lost ({fault.cause}) and no spare is left: "
                            f"{len(alloc.active) - 1} node(s) is below SLURMFT_MIN_NODES="
                            f"{self.min_nodes}", {node: "; ".join(fault.evidence)})
        self.alloc = alloc_mod.fence(alloc, node, fault.cause, time.time(), fault.evidence, spare)
        if was_active:
            self.process_faults.fenced()  # the restart that follows is this fence's
        steppoint.reached("launch.fence", node)
        self._publish()  # first: the ranks exit on the new generation
        action = "fence" if not was_active else "replace_node" if spare else "shrink"
        self.voice.event(journal.RECOVERY_ACTION, where=WHERE, action=action, nodes=[node],
                         spare=spare, world_nodes=len(self.alloc.active),
                         generation=self.alloc.generation, cause=fault.cause, ok=True)
        what = {"fence": "a spare: fenced", "replace_node": f"replaced by the spare {spare}",
                "shrink": f"dropped: training goes on on {len(self.alloc.active)} node(s)"}[action]
        self.voice.log(f"{node} {fault.cause}: {'; '.join(fault.evidence)} -> {what} "
                       f"(generation {self.alloc.generation})")
        if leaves:
            self._leaving[node] = _Leaving(time.monotonic() + rdzv_leave.LEAVE_GRACE_S,
                                           self.liveness.step_id(node), holder)
        elif not reaped:
            self._kill(node)
        self.liveness.forget(node)
        if spare is not None and spare not in self.steps:
            self._start(spare)

    def _end_leaving(self, now: bool = False) -> None:
        """Kill the step of each fenced node that left (its step ended) or had its
        ``LEAVE_GRACE_S`` (``now``: every one)."""
        for node, leaving in list(self._leaving.items()):
            step = self.steps.get(node)
            if step is not None and step.poll() is not None:
                leaving.rc = step.rc
            if not (now or leaving.rc is not None or time.monotonic() >= leaving.until):
                continue
            del self._leaving[node]
            if leaving.holder is not None and self.refill is not None:
                self.refill.cancel(leaving.holder)
            if leaving.rc == exitcodes.FENCED:   # its agent left and its task ended: nothing runs
                self.steps.pop(node, None)
                self.voice.log(f"the fenced {node}'s agent left the rendezvous and its step ended")
            else:   # still running, or its srun ended otherwise: its tasks may live on
                self._kill(node, leaving.step_id)

    def _journal_fault(self, fault: Fault) -> None:
        # A dead or silent node's fault is its last beat; a crash is seen as it happens.
        lag = self.liveness.silent_s(fault.node) if fault.cause != "rank_crash" else 0.0
        fault_time = time.time() - lag
        self.voice.event(journal.FAULT_DETECTED, where=WHERE, cause=fault.cause, nodes=[fault.node],
                         evidence=fault.evidence, fault_time=fault_time, detected_by="launcher")

    def _kill(self, node: str, step_id: str | None = None) -> None:
        """End the node's step: our srun at once (it may wait on a dead node for ever), and its
        tasks through Slurm (a frozen node's tasks must never come back)."""
        step = self.steps.pop(node, None)
        step_id = step_id or self.liveness.step_id(node)
        if step is not None and step.proc.poll() is None:
            try:
                os.killpg(step.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                step.proc.wait(timeout=STOP_KILL_AFTER_S)
            except subprocess.TimeoutExpired:  # unkillable: not waited on
                pass
        if self.alloc.spare_job_of(node) is not None:
            return   # its spare job is cancelled (``fence``): no step of this job to kill there
        if self.client is not None and step_id is not None:
            self.kills.send(node, step_id)

    def lost(self, exclude: Sequence[str]) -> list[str]:
        """The nodes this allocation lost (``exclude`` and every node fenced), but the batch
        host: its death is the job's end, and its step holds the launcher."""
        own = set(self.ident.nodes)  # a spare job's node is not this job's to release
        return [n for n in self.exclusions(dict.fromkeys(exclude, "")) if n in own]

    def exclusions(self, exclude: Mapping[str, str]) -> dict[str, str]:
        """What the requeue from this allocation excludes, each node with its evidence: every
        node fenced here (never used again by this job: the one whose loss ends the allocation
        and those lost before it, a spare's included) and ``exclude``; never the batch host."""
        found = {f.node: "; ".join(f.evidence) or f.cause for f in self.alloc.fenced}
        found.update({n: why or found.get(n, "") for n, why in exclude.items()})
        return {n: why for n, why in found.items() if n != self.rdzv.host}

    # -- signals and the end -------------------------------------------------------------------

    def _signal(self, name: str) -> None:
        self.on_signal(name)
        if self._next_send is None:
            self._next_send = time.monotonic()

    def _resend(self) -> None:
        if self._next_send is None or time.monotonic() < self._next_send:
            return
        for node, step in self.steps.items():
            if node in self.alloc.active and step.proc.poll() is None:
                step.proc.send_signal(signal.SIGUSR2)
        self._next_send = time.monotonic() + self.cfg.resignal_s

    def _stop_rest(self) -> None:
        """TERM every step left at once (a spare's agent waits on the rendezvous and trains
        nothing), KILL what is still there after ``STOP_KILL_AFTER_S``: the job's end takes the
        remote tasks with it."""
        self.node_states.stop()
        self._end_leaving(now=True)
        if self.refill is not None:   # every spare job ends with the training
            self.refill.close()
        running = [step for step in self.steps.values() if step.proc.poll() is None]
        for step in running:
            step.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_KILL_AFTER_S
        for step in running:
            try:
                step.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(step.proc.pid, signal.SIGKILL)
                    step.proc.wait(timeout=STOP_KILL_AFTER_S)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            self.voice.log(f"stopped the step on {step.node} (training ended)")
        self.steps.clear()
        if self.net is not None:  # only now: the other nodes' tasks watch it (``orphan``)
            self.net.close()
            self.net = None

    def _open_net(self) -> None:
        self.net = liveness.open_channel(self.rdzv.host, self.ident.nodes, self.voice.log)
        self.liveness.net = self.net

    def stop_all(self) -> None:
        self._stop_rest()

    def _publish(self) -> None:
        try:
            record.write(self.run_dir, self.alloc)
        except (OSError, record.AllocationError) as exc:
            self.voice.log(f"WARNING: could not write {self.run_dir.allocation}: {exc}")
