"""In-allocation mode: spares from outside the allocation, once the job's own are used.

A job starts with ``SLURMFT_SPARE_NODES=K`` spares of its own allocation; every node death
inside the allocation uses one, and the node death after the last is a requeue (30-40 s on the
devcluster, the scheduler's pace on a real cluster). With ``SLURMFT_SPARE_REFILL=1`` the
launcher asks Slurm for a replacement whenever fewer than K spares wait: a one-node job of its
own (the *holder*: ``sparehold``, whose batch script only waits), into whose allocation the
launcher then starts the node's task as a step (``srun --jobid=HOLDER``, the same task, warm
server and torchrun started ahead as an allocation's spare). Its torchrun joins the rendezvous
on the batch host over TCP, as every node's does, so such a spare takes a dead node's place the
same way and the world keeps its size. The holder's node is fenced by cancelling the holder.

Slurm schedules the holder as any job: it may wait in the queue (the spare comes when it comes;
the job goes on meanwhile and a node death without a spare is still a requeue), it is charged to
the user's share, and it asks for what ``SLURMFT_SPARE_SBATCH`` says (``--exclusive`` unless set:
a spare stands in for a whole training node; on a GPU cluster add the GPUs, e.g.
``--exclusive --gpus-per-node=8``: the node's step asks the holder for what the training job's
steps ask, its GPUs and CPUs per task, but not its task count or memory), in the main job's
partition, for the main job's time left and a margin (the launcher's cancel ends it, not its
limit), never on a node of this job or one it fenced. It ends when the launcher cancels it (the
node fenced, the training's end, the launcher's own requeue) or, should the launcher die or be
requeued by someone else, by itself (``sparehold``). A spare job's node fenced while it was still
a spare (it never trained: a step that cannot start there, a bad node) backs the next request
off as a refused one does, so a setting that makes every spare job unusable costs a few of them,
not one per poll.

The queries and the submissions run on this module's thread, never on the supervisor's loop: a
controller that answers slowly must not delay a fence. What cannot be had is said once and
tried again at the next poll.
"""

from __future__ import annotations

import math
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping, Sequence

from slurmft.launch import task
from slurmft.launch.settings import SettingsError
from slurmft.rundir import RunDir, atomic_write_bytes
from slurmft.slurm.client import JobState, SlurmError

POLL_S = 5.0
HOLDER_NAME = "slurmft-spare"
DEFAULT_SBATCH = ("--exclusive",)
MAX_SUBMITS = 64           # per launcher: a cluster that ends every holder at once must not be flooded
TIME_MARGIN_S = 300.0      # the holder's time limit: the main job's time left and this
# After a refused sbatch (no node can ever fit: every one excluded; the partition's limits) the
# next try waits, doubling from RETRY_S to RETRY_MAX_S: not one refused submission per poll.
RETRY_S = 30.0
RETRY_MAX_S = 600.0

# The holder's batch script, the same text for every job: what it needs comes through its
# environment (sbatch exports the submitter's), so nothing of a user's is ever written into it.
HOLDER_SCRIPT = b"""#!/bin/sh
# Written by slurmft's launcher (slurmft/launch/refill.py): a one-node job that holds its node
# as a hot spare of the training job $SLURMFT_SPARE_FOR; the launcher starts the node's task here.
exec "$SLURMFT_SPARE_PYTHON" -m slurmft.launch.sparehold
"""
FOR_ENV = "SLURMFT_SPARE_FOR"          # the main job's array-aware id
PYTHON_ENV = "SLURMFT_SPARE_PYTHON"
HOST_ALIVE_ENV = "SLURMFT_SPARE_HOST_ALIVE"  # the batch host's alive file: the launcher's pulse
SILENT_ENV = "SLURMFT_SPARE_SILENT_S"


def sbatch_options(env: Mapping[str, str]) -> tuple[str, ...]:
    """``SLURMFT_SPARE_SBATCH`` as sbatch options (shell words, each ``--name[=value]``)."""
    raw = env.get("SLURMFT_SPARE_SBATCH")
    if raw is None:
        return DEFAULT_SBATCH
    try:
        words = tuple(shlex.split(raw))
    except ValueError as exc:
        raise SettingsError(f"SLURMFT_SPARE_SBATCH={raw!r} cannot be split into words: {exc}") from None
    for word in words:
        if not word.startswith("--") or len(word) < 3 or "\x00" in word:
            raise SettingsError(f"SLURMFT_SPARE_SBATCH: {word!r} is not an sbatch option (--name[=value])")
        name = word[2:].split("=", 1)[0]
        if name not in ALLOWED_OPTIONS:
            raise SettingsError(f"SLURMFT_SPARE_SBATCH: --{name} is not one of the options a spare "
                                f"job takes ({', '.join(sorted(ALLOWED_OPTIONS))}; spelled out "
                                "whole: the launcher sets its size, place, time, name and output)")
    return words


# What a spare job may ask besides what the launcher sets (its size, partition, time, excluded
# nodes, name, output, environment): what a node is and whose account pays. Spelled out whole:
# sbatch takes any unique prefix of an option, which a list of refused names would let through.
ALLOWED_OPTIONS = frozenset({
    "exclusive", "gres", "gpus", "gpus-per-node", "cpus-per-gpu", "cpus-per-task", "constraint",
    "mem", "mem-per-cpu", "mem-per-gpu", "tmp", "account", "qos", "reservation", "licenses",
    "comment", "nice", "mail-type", "mail-user"})


@dataclass(frozen=True)
class Ready:
    job_id: str
    node: str


class Refill:
    """The holder jobs of one launcher: submitted while fewer spares wait than wanted, watched
    until they run (``take_ready``), cancelled with ``cancel``/``close``."""

    def __init__(self, client, ident, run_dir: RunDir, env: Mapping[str, str],
                 options: Sequence[str], log: Callable[[str], None], *,
                 batch_alive: Path, silent_s: float, poll_s: float = POLL_S,
                 python: str = sys.executable) -> None:
        self.client, self.ident, self.run_dir, self.log = client, ident, run_dir, log
        self.options, self.poll_s = tuple(options), poll_s
        self.env = {**env, FOR_ENV: ident.slurm_id, PYTHON_ENV: python,
                    HOST_ALIVE_ENV: str(batch_alive), SILENT_ENV: f"{silent_s:g}",
                    "SLURMFT_RUN_DIR": str(run_dir.root)}
        self._lock = threading.Lock()
        self._short = 0                        # spares wanted and not waiting (the loop's word)
        self._avoid: tuple[str, ...] = ()      # nodes a holder must not get (fenced by this job)
        self._pending: dict[str, str] = {}     # holder id -> "" (queued) or its node (running)
        self._ready: list[Ready] = []
        self._taken: set[str] = set()          # holders handed to the loop
        self._cancel: set[str] = set()
        self._all: list[str] = []              # every holder submitted (MAX_SUBMITS)
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._partition: str | None = None
        self._retry_s = 0.0
        self._next_submit = 0.0                # monotonic: no submission before
        self._limit_end: datetime | None = None

    # -- the supervisor's side ------------------------------------------------------------------

    def want(self, short: int, avoid: Sequence[str]) -> None:
        """``short`` more spares are wanted than wait now (holders not yet taken count as
        coming); holders never go to ``avoid``."""
        with self._lock:
            self._short, self._avoid = max(0, short), tuple(avoid)

    def take_ready(self) -> list[Ready]:
        """The holders that run, handed over once; each lowers the shortfall at once, so that
        the thread does not ask for another before the loop says ``want`` again."""
        with self._lock:
            ready, self._ready = self._ready, []
            self._taken.update(r.job_id for r in ready)
            self._short = max(0, self._short - len(ready))
            return ready

    def spoiled(self, job_id: str) -> None:
        """A holder's node was fenced before it ever trained: back the next request off."""
        with self._lock:
            self._back_off()
        self.log(f"the spare job {job_id}'s node was lost before it trained: the next spare job is "
                 f"asked for in {self._retry_s:g} s at the earliest")

    def pending(self) -> list[str]:
        """The holders submitted and not handed over yet (queued or starting)."""
        with self._lock:
            return [j for j in self._pending if j not in self._taken]

    def cancel(self, job_id: str) -> None:
        """End one holder (its node fenced): on the thread, never waited on here."""
        with self._lock:
            self._cancel.add(job_id)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="slurmft-refill")
        self._thread.start()

    def close(self, wait_s: float = 10.0) -> None:
        """Stop the thread and cancel every holder this launcher submitted that may still be
        there (a submission under way when the thread stops cancels its job itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=wait_s)
        with self._lock:
            left = sorted({*self._pending, *self._cancel})
            self._cancel.clear()
        for job_id in left:
            self._scancel(job_id)

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._round()
            except Exception as exc:  # noqa: BLE001  a bug here must not end the supervision
                self._warn("round", f"WARNING: spare refill: {type(exc).__name__}: {exc}")
            if self._stop.wait(self.poll_s):
                return

    def _round(self) -> None:
        with self._lock:
            cancel = sorted(self._cancel)
        for job_id in cancel:   # kept until Slurm took the cancel: tried again next round
            if self._scancel(job_id):
                with self._lock:
                    self._cancel.discard(job_id)
                    self._pending.pop(job_id, None)
        self._follow()
        with self._lock:
            coming = len([j for j in self._pending if j not in self._taken])
            need = self._short - coming
        if need <= 0 or self._stop.is_set() or time.monotonic() < self._next_submit:
            return
        if len(self._all) >= MAX_SUBMITS:
            self._warn("max", f"WARNING: spare refill: {MAX_SUBMITS} spare jobs asked for by this "
                              "launcher: no more (a node lost without a spare is a requeue)")
            return
        self._submit()

    def _follow(self) -> None:
        with self._lock:
            watched = [j for j, node in self._pending.items() if not node]
        if not watched:
            return
        try:
            jobs = self.client.jobs(watched)
        except SlurmError as exc:
            self._warn("jobs", f"WARNING: spare refill: could not read the spare job(s) "
                               f"{','.join(watched)}: {exc}")
            return
        for job_id in watched:
            job = jobs.get(job_id)
            if job is None or job.state.finished:
                state = "gone" if job is None else job.state.value
                self.log(f"the spare job {job_id} ended before its node was used ({state})")
                with self._lock:
                    self._pending.pop(job_id, None)
                continue
            if job.state is JobState.RUNNING and len(job.nodes) == 1:
                node = job.nodes[0]
                with self._lock:
                    bad = node in self._avoid
                if bad:  # cannot happen with --exclude honoured; never used if it does
                    self.log(f"the spare job {job_id} got {node}, a node of this job or one it "
                             "fenced: cancelled")
                    with self._lock:   # never handed over; cancelled next round (and retried)
                        self._pending[job_id] = node
                        self._taken.add(job_id)
                        self._cancel.add(job_id)
                    continue
                with self._lock:
                    self._pending[job_id] = node
                    self._ready.append(Ready(job_id, node))
                self.log(f"the spare job {job_id} runs on {node}")

    def _submit(self) -> None:
        script = self.run_dir.spares / "holder.sh"
        try:   # written afresh each time (atomically): never a file someone else left there
            script.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(script, HOLDER_SCRIPT, mode=0o755)
        except OSError as exc:
            self._warn("script", f"WARNING: spare refill: cannot write {script}: {exc}")
            return
        # The user's options first: the launcher's, last, win where sbatch reads both.
        options = [*self.options, f"--job-name={HOLDER_NAME}", "--nodes=1", "--ntasks=1",
                   f"--output={self.run_dir.spares}/job-%j.out", "--export=ALL", *self._placement()]
        try:
            job_id = self.client.submit(script, sbatch_options=options, env=self.env)
        except SlurmError as exc:
            with self._lock:
                self._back_off()
            self._warn("submit", f"WARNING: spare refill: sbatch of a spare job failed: {exc} "
                                 f"(tried again after {RETRY_S:g} s, then less and less often)")
            return
        with self._lock:
            self._pending[job_id] = ""
            self._all.append(job_id)
        self.log(f"asked Slurm for a spare node: job {job_id} ({' '.join(options)})")
        if self._stop.is_set():   # the launcher stopped while sbatch ran: close() may have missed it
            self._scancel(job_id)

    def _placement(self) -> list[str]:
        """The main job's partition, a time limit within its own, the fenced nodes excluded."""
        if self._partition is None:
            try:
                job = self.client.job(self.ident.slurm_id)
                self._partition, self._limit_end = job.partition, job.time_limit_end
            except SlurmError as exc:
                self._warn("main", f"WARNING: spare refill: could not read job {self.ident.slurm_id} "
                                   f"({exc}): its spares go to the default partition")
                self._partition = ""
        out = [f"--partition={self._partition}"] if self._partition else []
        if self._limit_end is not None:
            end = self._limit_end if self._limit_end.tzinfo else self._limit_end.replace(tzinfo=timezone.utc)
            left = (end - datetime.now(timezone.utc)).total_seconds() + TIME_MARGIN_S
            out.append(f"--time={max(1, math.ceil(left / 60))}")
        with self._lock:
            avoid = sorted(self._avoid)
        if avoid:
            out.append(f"--exclude={','.join(avoid)}")
        return out

    def _back_off(self) -> None:   # under the lock
        self._retry_s = min(RETRY_MAX_S, max(RETRY_S, 2 * self._retry_s))
        self._next_submit = time.monotonic() + self._retry_s

    def _scancel(self, job_id: str) -> bool:
        try:
            self.client.cancel(job_id)
            return True
        except SlurmError as exc:
            self.log(f"WARNING: could not cancel the spare job {job_id}: {exc} (tried again; it "
                     "ends by itself once the launcher is gone)")
            return False

    def _warn(self, key: str, line: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log(line)


def enabled(env: Mapping[str, str]) -> bool:
    flag = (env.get("SLURMFT_SPARE_REFILL") or "").strip()
    if flag not in ("", "0", "1"):
        raise SettingsError(f"SLURMFT_SPARE_REFILL={flag!r} must be 0 or 1")
    return flag == "1"


def step_environ(env: Mapping[str, str], main_raw_id: str, restart_count: int) -> dict[str, str]:
    """What the launcher adds to a holder's step, so that its task and everything under it (the
    ranks' journal, heartbeats, a requeue from there) name the training job, not the holder
    (``task.adopt_main_job``)."""
    out = {task.AS_JOB_ENV: main_raw_id, task.AS_RESTART_ENV: str(restart_count)}
    for name in task.ADOPTED:
        if env.get(name):
            out[task.AS_PREFIX + name] = env[name]
    return out


# srun reads these as its own options' defaults: the training job's, they would ask the holder's
# one-node allocation for the training job's task layout and memory (its own memory is what its
# sbatch options gave it). Its CPUs and GPUs per task or node are asked as the training job's.
_STEP_INPUTS = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE",
                "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU",
                "SLURM_DISTRIBUTION")


def step_env(env: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment for a step in a holder's allocation."""
    return {k: v for k, v in env.items() if k not in _STEP_INPUTS}
