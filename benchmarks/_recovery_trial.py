"""One trial of ``recovery_bench.py``: one job on a devcluster, one fault, one recovery mode.

Modes: ``watch`` (the requeue path with ``slurmft watch``), ``slurm`` (Slurm alone: the template's
``--requeue`` and nothing else), ``operator`` (``slurmft watch --operator``), ``inalloc`` (the
launcher's in-allocation mode with one hot spare: ``SLURMFT_SPARE_NODES=1``, ``sbatch --no-kill``,
one node more than the world) and ``shrink`` (in-allocation without a spare:
``SLURMFT_IN_ALLOCATION=1``, ``SLURMFT_MIN_NODES`` one below the world). The in-allocation modes
run with ``slurmft watch`` beside them, as a user would. Every mode trains on ``NODES`` active
nodes. "Training again" is the first loss of the first segment that started after the fault (a
requeue's next run or torchrun's next attempt alike); its step against the segment's restored
step says whether the run came back at the restored step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from slurmft.chaos.faults import rank_pids  # noqa: E402
from slurmft.journal import read_events  # noqa: E402
from slurmft.rundir import RunDir  # noqa: E402
from slurmft.slurm.cli import CliSlurmClient  # noqa: E402
from slurmft.slurm.client import JobState  # noqa: E402
from slurmft.slurm.devcluster import DevCluster  # noqa: E402
from slurmft.slurm.devcluster.cluster import slurmd_key  # noqa: E402
from slurmft.slurm.devcluster.daemons import NODE_MARK_ENV  # noqa: E402
from slurmft.slurm.devcluster.nodeprocs import node_processes  # noqa: E402

TEMPLATE = REPO / "sbatch_templates" / "train.sbatch"
EXAMPLE = REPO / "examples" / "train_gpt.py"
NODES = 3
TRAIN_ARGS = ["--tiny", "--global-batch", "12", "--heartbeat-interval", "0.5", "--ckpt-every", "5",
              "--step-sleep", "0.1", "--steps", "100000", "--watchdog-timeout", "3600"]
POLL_S = 1.0
HANG_TIMEOUT_S = 10.0
# Beside an in-allocation run the watcher keeps its floor (60 s): a restart in place by torchrun
# leaves the heartbeats still for more than 10 s on a loaded box, and a 10 s hang timeout then
# requeued the job before torchrun had re-formed its world (measured twice, 2026-11-26).
INALLOC_HANG_TIMEOUT_S = 60.0
# In the allocation a hang is the ranks' own: their step watchdog (the soak's 10 s) ends the
# world and torchrun restarts it in place; on the requeue path 3600 s leaves it to the watcher.
INALLOC_WATCHDOG_S = 10.0
MODES = {"watch": "slurmft watch (requeue)", "slurm": "Slurm alone", "operator": "slurmft watch --operator",
         "inalloc": "in-allocation, 1 spare", "shrink": "in-allocation, shrink",
         "spent": "in-allocation, no spare left (requeue)",
         "spare2": "in-allocation, the spare used, then a 2nd node death (requeue)"}
IN_ALLOCATION = ("inalloc", "shrink", "spent", "spare2")
REQUEUES = ("spent", "spare2")  # in the allocation, but the fault measured is a requeue
# node_freeze: every process of a node SIGSTOPped, slurmd included. On this one-host devcluster
# a killed node's sockets are closed by the kernel (its peers see a reset at once); a frozen node
# keeps them open and answers nothing, as a powered-off or hung node on a real network does.
FAULTS = ("node_death", "node_freeze", "hang", "crash")
NODE_FAULTS = ("node_death", "node_freeze")
ENDED_S = 15.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def mode_job(mode: str) -> tuple[int, list[str], dict[str, str]]:
    """Nodes to ask for, extra sbatch options and launcher settings of a mode."""
    if mode in ("inalloc", "spare2"):
        return NODES + 1, ["--no-kill"], {"SLURMFT_SPARE_NODES": "1"}
    if mode == "shrink":
        return NODES, ["--no-kill"], {"SLURMFT_IN_ALLOCATION": "1", "SLURMFT_MIN_NODES": str(NODES - 1)}
    if mode == "spent":  # a spare already used: no spare, no room to shrink -> the requeue path
        return NODES, ["--no-kill"], {"SLURMFT_IN_ALLOCATION": "1", "SLURMFT_MIN_NODES": str(NODES)}
    return NODES, [], {}


class Trial:
    """One job with one fault, recovered by one mode."""

    def __init__(self, cluster: DevCluster, root: Path, fault: str, mode: str, tag: str = "") -> None:
        self.cluster, self.fault, self.mode = cluster, fault, mode
        self.watched = mode != "slurm"
        self.client = CliSlurmClient(env=cluster.env)
        self.run = root / f"{fault}-{mode}{tag}"
        self.log = self.run.parent / f"{self.run.name}.out"
        nodes, options, settings = mode_job(mode)
        env = {**os.environ, **cluster.env, "OMP_NUM_THREADS": "1", "SLURMFT_PYTHON": sys.executable,
               "SLURMFT_RUN_DIR": str(self.run), **settings}
        train_args = list(TRAIN_ARGS)
        if fault == "hang" and mode in IN_ALLOCATION:
            train_args[train_args.index("--watchdog-timeout") + 1] = f"{INALLOC_WATCHDOG_S:g}"
        self.job_id = self.client.submit(TEMPLATE, [str(EXAMPLE), *train_args], env=env,
                                         sbatch_options=[f"--nodes={nodes}", *options,
                                                         f"--output={self.log}", f"--chdir={root}",
                                                         "--time=60"])
        self.watcher: subprocess.Popen | None = None
        self.stopped: list[int] = []
        self.victim: str | None = None
        self.states: set[str] = set()
        self.ended_since: float | None = None
        self.timeline: list[tuple] = []
        self.first_victim: str | None = None

    def events(self, kinds: list[str] | None = None):
        return read_events(RunDir(self.run).events, kinds)

    def wait(self, predicate, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.25)
        return None

    def start(self) -> None:
        ok = self.wait(lambda: any((e.get("step") or 0) >= 10
                                   for e in self.events(["checkpoint_committed"])), 300)
        if not ok:
            raise RuntimeError(f"job {self.job_id} never checkpointed step 10; see {self.log}")
        if self.mode in ("inalloc", "spare2"):  # a hot spare is one whose agent runs: wait for its beat
            spares = [n for n in self.allocation().get("spares") or [] if isinstance(n, str)]
            run = RunDir(self.run)
            if not self.wait(lambda: all(run.alive(n).exists() for n in spares), 120):
                raise RuntimeError(f"job {self.job_id}: the spares {spares} never beat; see {self.log}")
        if self.watched:
            self.watcher = subprocess.Popen(
                [sys.executable, "-m", "slurmft.cli", "watch", self.job_id, "--poll", str(POLL_S),
                 "--hang-timeout", str(INALLOC_HANG_TIMEOUT_S if self.mode in IN_ALLOCATION
                                       else HANG_TIMEOUT_S),
                 *(["--operator"] if self.mode == "operator" else [])],
                env={**os.environ, **self.cluster.env}, stdout=subprocess.DEVNULL,
                stderr=open(self.run.parent / f"{self.run.name}-watch.log", "wb"),
                start_new_session=True)
            time.sleep(3 * POLL_S)  # it has seen the job running

    def allocation(self) -> dict:
        path = RunDir(self.run).root / "allocation.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"{self.mode}: cannot read {path}: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("active"), list):
            raise RuntimeError(f"{self.mode}: {path} has no 'active' list")
        return data

    def pick_victim(self) -> str:
        job = self.client.job(self.job_id)
        batch = job.batch_host or job.nodes[0]  # Slurm's batch host is the allocation's first
        if self.mode not in IN_ALLOCATION:
            return [n for n in job.nodes if n != batch][-1]
        # a node that trains and is not the batch host
        active = [n for n in self.allocation()["active"] if isinstance(n, str) and n != batch]
        if not active:
            raise RuntimeError(f"job {self.job_id}: no active node besides the batch host {batch}")
        return active[-1]

    def inject(self) -> float:
        if self.mode == "spare2":  # the spare takes a first dead node's place; then the fault
            first = self.pick_victim()
            self.cluster.kill_node(first)
            killed = time.time()
            if not self.wait(lambda: self.back(killed), 180):
                raise RuntimeError(f"job {self.job_id}: no training after the spare took {first}'s place")
            self.first_victim = first
        if self.fault == "node_death":
            self.victim = self.pick_victim()
            self.cluster.kill_node(self.victim)
        elif self.fault == "node_freeze":
            self.victim = self.pick_victim()
            freeze_node(self.cluster, self.victim)
        elif self.fault == "hang":
            self.stopped = signal_rank(self.cluster, self.job_id, 1, signal.SIGSTOP, training_only=True)
        else:  # a rank crashes on a healthy node (not the batch host's rank 0)
            if not signal_rank(self.cluster, self.job_id, 1, signal.SIGKILL):
                raise RuntimeError(f"job {self.job_id}: no rank 1 to kill")
        return time.time()

    def back(self, fault_at: float) -> dict | None:
        """The first segment started after the fault, once it has journaled a loss."""
        started = None
        for event in self.events(["segment_start", "loss", "restart_phases"]):
            if event.time is None or event.time < fault_at:
                continue
            if started is None:
                if event.kind == "segment_start":
                    started = event
                continue
            if event.kind == "loss":
                return {"time": event.time, "step": event.get("step"),
                        "restored_step": started.get("restored_step"),
                        "world_size": started.get("world_size"), "attempt": started.get("attempt"),
                        "restart_count": started.get("restart_count")}
        return None

    def observe(self, predicate):
        """``predicate``, noting the job's state on the way (did it ever leave RUNNING?). With
        Slurm alone, a job that stayed ended for ``ENDED_S`` after a crash or hang (nothing requeues it) ends
        the wait early; a requeue passes through ended-looking states only briefly."""
        try:
            job = self.client.job(self.job_id)
            state = job.state
            self.states.add(state.value)
            self._note(job)
            if not state.finished:
                self.ended_since = None
            elif self.mode == "slurm" and self.fault not in NODE_FAULTS:
                self.ended_since = self.ended_since or time.monotonic()
                if time.monotonic() - self.ended_since >= ENDED_S:
                    return {"ended": state.value}
        except Exception:  # noqa: BLE001 - could not observe: try again next poll
            pass
        return predicate()

    def _note(self, job) -> None:
        """The job's timeline: each change of its state, reason or restart count, when seen."""
        seen = (job.state.value + (" COMPLETING" if job.completing else ""), job.reason,
                job.restart_count)
        if not self.timeline or self.timeline[-1][1:] != seen:
            self.timeline.append((time.time(), *seen))

    def phases(self, fault_at: float, down_at: float | None, back: dict | None) -> dict:
        """Where a requeue's seconds go, each phase's end in seconds after the fault: from the
        journal (the launcher's detection and requeue, the watcher's actions, the new run's
        start and its ranks' restart_phases), the job's states as polled and the node's DOWN."""
        def after(t):
            return None if t is None else round(t - fault_at, 2)

        def first(kind, **match):
            for e in self.events([kind]):
                if e.time and e.time >= fault_at and all(e.get(k) == v for k, v in match.items()):
                    return e
            return None

        out: dict = {}
        e = first("fault_detected")
        out["detected"] = after(e.time if e else None)
        e = first("template", action="requeue")
        out["launcher_requeue"] = after(e.time if e else None)
        for t, state, reason, restarts in self.timeline:
            if t < fault_at:
                continue
            if state != "RUNNING" and "left_running" not in out:
                out["left_running"] = after(t)
            if state.startswith("PENDING") and "pending" not in out:
                out["pending"] = after(t)
                out["pending_reason"] = reason
            if state == "RUNNING" and restarts >= 1 and "running_again" not in out:
                out["running_again"] = after(t)
        out["node_down"] = after(down_at)
        for e in self.events(["recovery_action"]):
            if e.time and e.time >= fault_at and e.get("where") != "allocation":
                out.setdefault(f"watch_{e.get('action')}", after(e.time))
        e = first("segment_start")
        out["segment_start"] = after(e.time if e else None)
        out["training_again"] = after(back["time"] if back else None)
        out["timeline"] = [(after(t), state, reason, restarts) for t, state, reason, restarts
                           in self.timeline if t >= fault_at - 1]
        return out

    def measure(self, cap: float) -> dict:
        self.start()
        fault_at = self.inject()
        result: dict = {"fault": self.fault, "mode": self.mode, "watched": self.watched,
                        "victim": self.victim}
        down = None
        if self.fault in NODE_FAULTS and self.mode not in ("inalloc", "shrink"):
            down = self.wait(lambda: self.observe(
                lambda: self.client.nodes([self.victim])[self.victim].down and time.time()), cap)
            running = self.wait(lambda: self.observe(
                lambda: (j := self.client.job(self.job_id)).state is JobState.RUNNING
                and j.restart_count >= 1 and time.time()), cap)
            result["down_to_running_s"] = running - down if down and running else None
        back = self.wait(lambda: self.observe(lambda: self.back(fault_at)), cap)
        if back and "ended" in back:
            result["ended"], back = back["ended"], None
        if self.mode in REQUEUES or (self.fault in NODE_FAULTS and self.mode not in IN_ALLOCATION):
            result["requeue_phases"] = self.phases(fault_at, down, back)
        result["recovered"] = back is not None
        result["recover_s"] = back["time"] - fault_at if back else None
        result["back"] = back
        if back:
            result["at_restored_step"] = (back["restored_step"] is not None
                                          and back["step"] == back["restored_step"] + 1)
        detected = [e for e in self.events(["fault_detected"]) if e.time and e.time >= fault_at]
        result["detect_s"] = detected[0].time - fault_at if detected else None
        result["detected_by"] = detected[0].get("detected_by") or "watch" if detected else None
        result["where"] = detected[0].get("where") if detected else None
        phases = [e for e in self.events(["restart_phases"]) if e.time and e.time >= fault_at]
        result["restart_phases"] = phases[0].fields if phases else None
        job = self.client.job(self.job_id)
        self.states.add(job.state.value)
        result["slurm_state"] = job.state.value
        result["job_states_seen"] = sorted(self.states)
        result["restart_count"] = job.restart_count
        if self.mode in IN_ALLOCATION:
            try:
                alloc = self.allocation()
                result["allocation"] = {k: alloc.get(k) for k in ("generation", "active", "spares")}
                result["fenced"] = [f.get("node") for f in alloc.get("fenced") or []
                                    if isinstance(f, dict)]
            except RuntimeError as exc:
                result["allocation"] = str(exc)
        return result

    def close(self) -> None:
        if self.watcher is not None and self.watcher.poll() is None:
            os.killpg(self.watcher.pid, signal.SIGKILL)
            self.watcher.wait(10)
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        try:
            self.client.cancel(self.job_id)
        except Exception:  # noqa: BLE001 - cleaning up; reset() settles the cluster
            pass
        if self.first_victim is not None:
            self.cluster.start_node(self.first_victim)
        if self.victim is not None:
            if self.fault == "node_freeze":
                self.cluster.kill_node(self.victim)  # SIGKILL ends stopped processes too
            self.cluster.start_node(self.victim)


def freeze_node(cluster: DevCluster, name: str) -> None:
    """SIGSTOP every process of the node (two passes: a process forked before the first stop
    is caught by the second, and a stopped process cannot fork)."""
    for _ in range(2):
        for proc in node_processes(cluster.cluster_name, name, cluster.processes().get(slurmd_key(name)),
                                   NODE_MARK_ENV):
            try:
                os.kill(proc.pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass


def signal_rank(cluster: DevCluster, job_id: str, rank: int | None, sig: int,
                training_only: bool = False) -> list[int]:
    """Send ``sig`` to the python rank processes of the job (``rank`` None: every rank; with
    ``training_only`` a warm rank's worker, not its client: ``faults.rank_pids``)."""
    hit = []
    for pid in rank_pids(cluster.cluster_name, job_id, EXAMPLE, rank=rank, training_only=training_only):
        try:
            os.kill(pid, sig)
            hit.append(pid)
        except ProcessLookupError:
            pass
    return hit
