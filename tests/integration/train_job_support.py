"""Support for the training-job integration tests: submit the real sbatch template running the
real example on the devcluster, drive requeues, and read the run's journal back.

Slurm is reached through ``slurmft.slurm.CliSlurmClient``. A requeued job is started again by the
real ``slurmft watch`` (``submit(..., watch=True)``), never by the test: ``StartTime=now`` is the
watcher's job. Watchers started here are stopped after each test (tests/integration/conftest.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from slurmft.chaos.reference import ReferenceRunError, uninterrupted_run
from slurmft.journal import Event, read_events
from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import Job
import reference_cache
from watch_support import WatcherProc

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "sbatch_templates" / "train.sbatch"
EXAMPLE = REPO / "examples" / "train_gpt.py"
# Tiny and deterministic: 2 cores run every rank, so one thread per rank.
TINY_ARGS = ["--tiny", "--global-batch", "12", "--heartbeat-interval", "0.5"]
# The tests wait for given steps' losses and compare a crashed segment's last steps: every loss
# line must be on disk at once, not buffered until the next checkpoint (the default).
JOB_ENV = {"OMP_NUM_THREADS": "1", "SLURMFT_PYTHON": sys.executable,
           "SLURMFT_JOURNAL_FLUSH_EVERY_EVENTS": "1"}


@dataclass
class TrainJob:
    client: CliSlurmClient
    run_dir: Path
    job_id: str
    log: Path
    watcher: WatcherProc | None = None

    def watch(self, cluster) -> "TrainJob":
        """Start the real ``slurmft watch`` for this job (stopped after the test)."""
        self.watcher = WatcherProc(cluster, [self.job_id], self.run_dir.parent / f"{self.run_dir.name}-watch.log",
                                   run_dir=self.run_dir)
        _WATCHERS.append(self.watcher)
        return self

    def state(self) -> Job:
        return self.client.job(self.job_id)

    def events(self, kinds: list[str] | None = None) -> list[Event]:
        return read_events(RunDir(self.run_dir).events, kinds)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no job log)"

    def _observe(self) -> Job:
        return self.state()

    def context(self) -> str:
        """The job's log tail and its watcher's, for an assertion message."""
        text = self.log_text()[-4000:]
        return text + ("\n--- watcher ---\n" + self.watcher.text()[-3000:] if self.watcher else "")

    def wait_for(self, predicate, timeout: float, what: str) -> Job:
        """Poll until ``predicate(job)``."""
        deadline = time.monotonic() + timeout
        while True:
            job = self._observe()
            if predicate(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.job_id}: no {what} within {timeout:.0f} s; last "
                                     f"state {job.state.value} ({job.reason})\n{self.context()}")
            time.sleep(0.5)

    def wait_finished(self, timeout: float) -> Job:
        return self.wait_for(lambda j: j.state.finished, timeout, "end")

    def wait_step(self, step: int, timeout: float) -> None:
        """Until rank 0 journaled the loss of ``step`` (in the current segment)."""
        deadline = time.monotonic() + timeout
        while not any(e.get("step", -1) >= step for e in self.events(["loss"])):
            job = self._observe()
            if job.state.finished or time.monotonic() > deadline:
                raise AssertionError(f"job {self.job_id} never reached step {step} (state "
                                     f"{job.state.value})\n{self.context()}")
            time.sleep(0.3)


def kill_ranks(cluster, job_id: str, script: Path = EXAMPLE, node: str | None = None) -> int:
    """kill -9 every training rank of ``cluster``'s job ``job_id`` running ``script`` (a crash:
    no handler runs); returns how many. The cluster's name is part of the match: every xdist
    worker's devcluster numbers its jobs from 1, and a kill by job id alone killed another
    worker's job of the same number (seen: a healthy run in test_watch_planned crashed by
    test_run_adoption's kill on another cluster)."""
    mine = [f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_CLUSTER_NAME={cluster.cluster_name}".encode()]
    if node is not None:  # only that node's ranks
        mine.append(f"SLURMD_NODENAME={node}".encode())
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        argv = cmdline.split(b"\0")
        # A rank is `python -u train_gpt.py ...` (torchrun and the bash wrapper name it later),
        # or with warm workers its client `python -I -S .../warmclient.py -- train_gpt.py ...`
        # (the forked worker dies with it, as a rank would).
        if all(var in environ for var in mine) and (str(script).encode() in argv[1:3] or (
                argv[3:4] and argv[3].endswith(b"warmclient.py") and argv[5:6] == [str(script).encode()])):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


_WATCHERS: list[WatcherProc] = []


def stop_watchers() -> None:
    """Kill every watcher ``TrainJob.watch`` started (after each test)."""
    while _WATCHERS:
        _WATCHERS.pop().kill()


def submit(cluster, run_dir: Path, train_args: list[str], *, nodes: int | str,
           sbatch_options: list[str] = (), env: dict[str, str] | None = None,
           script: Path = EXAMPLE, watch: bool = False) -> TrainJob:
    """Submit the template; ``watch``: with the real ``slurmft watch`` beside it."""
    client = CliSlurmClient(env=cluster.env)
    log = run_dir.parent / f"{run_dir.name}-job.out"
    job_env = {**os.environ, **cluster.env, **JOB_ENV, "SLURMFT_RUN_DIR": str(run_dir), **(env or {})}
    job_id = client.submit(TEMPLATE, [str(script), *train_args], env=job_env,
                           sbatch_options=[f"--nodes={nodes}", f"--output={log}",
                                           f"--chdir={run_dir.parent}", *sbatch_options])
    job = TrainJob(client, run_dir, job_id, log)
    return job.watch(cluster) if watch else job


def losses(events: list[Event]) -> dict[int, tuple[float, int]]:
    """step -> (loss, sample digest), asserting that no step was journaled twice."""
    found: dict[int, tuple[float, int]] = {}
    for event in events:
        if event.kind != "loss":
            continue
        step = event.get("step")
        assert step not in found, f"step {step} journaled twice (repeated work)"
        found[step] = (event.get("loss"), event.get("samples"))
    return found


_REFERENCES: dict[tuple, dict[int, tuple[float, int]]] = {}


# Options of the examples' that change no loss, only how long a run takes or what it saves on the
# way (while the guard does not trip: _reference_run checks): a reference is made without them,
# so runs that differ only there share one.
NO_LOSS_OPTIONS = ("--step-sleep", "--ckpt-every")


def reference_args(train_args: list[str]) -> list[str]:
    """``train_args`` less ``--step-sleep S`` (both examples' and the helper loops' only use of
    it is a ``time.sleep`` in each step) and ``--ckpt-every N`` (a save changes no loss: that is
    what resuming bit for bit means; a reference that saves nothing on the way proves it too)."""
    args = list(train_args)
    for option in NO_LOSS_OPTIONS:
        while option in args:
            at = args.index(option)
            del args[at:at + 2]
    return args


# examples/train_gpt.py's step k is the same in a run of any length (no schedule over the run's
# length; checked: a 30- and a 40-step 2-rank run's losses are an 80-step run's first 30 and 40,
# bit for bit): its references are made at least REFERENCE_STEPS long and cut to the steps asked,
# so the 20-, 40- and 80-step tests of one world share one run.
REFERENCE_STEPS = 80


def reference_losses(run_dir: Path, train_args: list[str], world_size: int, *,
                     script: Path = EXAMPLE, env: dict[str, str] | None = None) -> dict[int, tuple[float, int]]:
    """An uninterrupted run on ``world_size`` local ranks (torchrun --standalone, no Slurm).
    Deterministic: the same run is made once per pytest run (reference_cache: shared by its
    xdist workers) and its losses handed out again (eight tests compare against the same 2-rank
    run). Made without the job's ``--step-sleep`` and ``--ckpt-every`` (``reference_args``): a
    job's 4 s steps made a 160 s reference, and the in-allocation and preemption tests, which
    differ only in their checkpoint interval, share one; and, for train_gpt.py, at least
    ``REFERENCE_STEPS`` long."""
    train_args = reference_args(train_args)
    asked = None
    if script == EXAMPLE and "--steps" in train_args:
        at = train_args.index("--steps") + 1
        asked = int(train_args[at])
        train_args[at] = str(max(asked, REFERENCE_STEPS))
    key = (str(script), tuple(train_args), world_size, tuple(sorted((env or {}).items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_cache.shared(
            run_dir, key, lambda: _reference_run(run_dir, train_args, world_size, script, env))
    return {step: v for step, v in _REFERENCES[key].items() if asked is None or step <= asked}


def _reference_run(run_dir: Path, train_args: list[str], world_size: int, script: Path,
                   env: dict[str, str] | None) -> dict[int, tuple[float, int]]:
    # The demo's and the soak's uninterrupted run (slurmft.chaos.reference): its ranks forked
    # warm as a job's are, one import of torch instead of one per rank.
    try:
        events = uninterrupted_run(run_dir, script, train_args, world_size,
                                   env={**JOB_ENV, **(env or {})}, timeout=240)
    except ReferenceRunError as exc:
        raise AssertionError(str(exc)) from None
    trips = [e.get("step") for e in events if e.kind == "guard_trip"]
    # A job that checkpoints rolls back at a trip; this run, without checkpoints, skips the step.
    assert not trips, (f"the uninterrupted run's guard tripped at step(s) {trips}: its losses "
                       f"cannot be a checkpointing job's; choose a model, seed or length without a trip")
    return losses(events)
