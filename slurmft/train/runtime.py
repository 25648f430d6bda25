"""Who and where this training process is, and how its segment of the run begins and ends.

``JobEnv`` is the ONE reader of the job's environment: rank, local rank, world size (torchrun's
``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, else srun's ``SLURM_PROCID``/``SLURM_LOCALID``/
``SLURM_NTASKS``), the node name, the Slurm job id (and the launcher's array-aware one), the
restart count, torchrun's attempt and the node list are read here once, validated, and passed
around frozen; no other module reads ``SLURM_*`` or ``TORCHELASTIC_*`` variables.

``Segment`` is one run of the job, keyed (job id, restart count, attempt): ``attempt`` is torchrun's
``TORCHELASTIC_RESTART_COUNT`` (0 when absent), which moves when torchrun restarts its workers
inside one job segment (in-allocation recovery), so every event the ranks journal carries it. It
journals the segment's start and its end, and ends the process with a code from ``slurmft.exitcodes``. The end is journaled
before the exit because torchrun reports any failing worker as exit 1: the sbatch template reads
the real outcome back with ``python -m slurmft.journal outcome``. Torch-free (a barrier, when
needed, is passed in).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn

from slurmft import exitcodes, journal
from slurmft.journal import Journal, JournalConfig
from slurmft.rundir import RunDir, atomic_write_bytes
from slurmft.train import torch_check


class JobEnvError(ValueError):
    """An environment variable the job depends on has a wrong value; the message names it."""


@dataclass(frozen=True)
class JobEnv:
    """Who and where this process is, read once by ``from_environ()`` (see the module docstring).

    rank, local_rank, world_size, local_world_size: torchrun's, else srun's. node: this node's name.
    job_id, restart_count, num_nodes, nodelist: Slurm's (None/0/1/None outside Slurm).
    pg_timeout_s: collective timeout for ``init_process_group`` (``$SLURMFT_PG_TIMEOUT_S``, 600).
    attempt: torchrun's restart count of the workers (``$TORCHELASTIC_RESTART_COUNT``, 0).
    slurm_id: the launcher's array-aware job id (``$SLURMFT_JOB_ID``, else ``job_id``): the one
    ``allocation.json`` and the launcher's journal lines name.
    node_silent_s: in-allocation mode, how long the launcher lets a node be silent before it fences
    it (``$SLURMFT_NODE_SILENT_S``, which the launcher sets on every node's step; 5 without it).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node: str
    job_id: str | None
    restart_count: int
    num_nodes: int
    nodelist: str | None
    pg_timeout_s: float = 600.0
    attempt: int = 0
    slurm_id: str | None = None
    node_silent_s: float = 5.0

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        """Local rank 0: the one process per node that writes the node's heartbeat."""
        return self.local_rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "JobEnv":
        env = os.environ if environ is None else environ

        def integer(names: tuple[str, ...], default: int, minimum: int) -> int:
            for name in names:
                raw = env.get(name)
                if raw is None or raw == "":
                    continue
                try:
                    value = int(raw)
                except ValueError:
                    raise JobEnvError(f"${name}={raw!r} is not an integer") from None
                if value < minimum:
                    raise JobEnvError(f"${name}={value} must be >= {minimum}")
                return value
            return default

        world = integer(("WORLD_SIZE", "SLURM_NTASKS"), 1, 1)
        rank = integer(("RANK", "SLURM_PROCID"), 0, 0)
        if rank >= world:
            raise JobEnvError(f"rank {rank} is not below the world size {world}")
        local_world = integer(("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"), 1, 1)
        local_rank = integer(("LOCAL_RANK", "SLURM_LOCALID"), 0, 0)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=local_world,
            node=env.get("SLURMD_NODENAME") or socket.gethostname(),
            job_id=env.get("SLURM_JOB_ID") or None,
            restart_count=integer(("SLURM_RESTART_COUNT",), 0, 0),
            num_nodes=integer(("SLURM_JOB_NUM_NODES", "SLURM_NNODES"), 1, 1),
            nodelist=env.get("SLURM_JOB_NODELIST") or None,
            pg_timeout_s=float(integer(("SLURMFT_PG_TIMEOUT_S",), 600, 1)),
            attempt=integer(("TORCHELASTIC_RESTART_COUNT",), 0, 0),
            slurm_id=env.get("SLURMFT_JOB_ID") or env.get("SLURM_JOB_ID") or None,
            node_silent_s=_seconds(env.get("SLURMFT_NODE_SILENT_S"), 5.0),
        )


def _seconds(raw: str | None, default: float) -> float:
    """A positive, finite number of seconds from the launcher's environment, else ``default``
    (the launcher refuses a bad value before any rank starts)."""
    try:
        value = float(raw) if raw else default
    except ValueError:
        return default
    return value if 0 < value < 1e6 else default


class RunDirError(OSError):
    """The run directory cannot be used; the message names the path and the reason."""


def check_run_dir_writable(run_dir: RunDir) -> None:
    """Create the run directory if needed and prove it writable with one atomic probe write.

    ``os.access`` is not enough: root passes it on read-only mounts and jobs often run as root.
    """
    probe = run_dir.root / f".slurmft-probe-{socket.gethostname()}-{os.getpid()}"
    if run_dir.root.exists() and not run_dir.root.is_dir():
        raise RunDirError(f"run directory {run_dir.root} is not writable: it is not a directory")
    try:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(probe, b"probe\n")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(f"run directory {run_dir.root} is not writable: "
                          f"{exc.strerror or exc}") from None


class Segment:
    """Journal the start and end of this segment; ``end`` exits the process with the given code.

    env: this process's :class:`JobEnv` (only rank 0 journals). run_dir: where the journal is.
    """

    def __init__(self, env: JobEnv, run_dir: RunDir) -> None:
        self.env = env
        flushing = JournalConfig.load()  # per-step events buffered ([journal], SLURMFT_JOURNAL_*)
        self.journal = Journal(run_dir, job_id=env.job_id, restart_count=env.restart_count,
                               attempt=env.attempt,
                               flush_every_events=flushing.flush_every_events,
                               flush_every_s=flushing.flush_every_s)

    def record(self, kind: str, /, **fields: Any) -> None:
        """Journal an event from rank 0 only (events every rank would write identically)."""
        if self.env.is_rank0:
            self.journal.append(kind, **fields)

    def started(self, *, restored_step: int | None, **extra: Any) -> None:
        self.record(journal.SEGMENT_START, world_size=self.env.world_size,
                    num_nodes=self.env.num_nodes, nodelist=self.env.nodelist,
                    node=self.env.node, restored_step=restored_step, **extra)

    def finish(self, code: int, reason: str, *, step: int | None = None,
               barrier: Callable[[], None] | None = None, announce: str = "every rank",
               journal_here: bool | None = None) -> None:
        """Journal ``segment_end`` (rank 0, or this rank when ``journal_here`` says so) and wait
        for every rank, without exiting.

        A non-zero ``code`` is announced on stderr in one line, by every rank or, with
        ``announce="rank 0"``, by rank 0 only (one line for the whole job).
        """
        if announce not in ("every rank", "rank 0"):
            raise ValueError(f"announce must be 'every rank' or 'rank 0', got {announce!r}")
        if code != exitcodes.OK and (announce == "every rank" or self.env.is_rank0):
            who = f"rank {self.env.rank}" if announce == "every rank" else f"{self.env.world_size} rank(s)"
            print(f"slurmft: {who}: {reason} -> {exitcodes.describe(code)}",
                  file=sys.stderr, flush=True)
        fields = dict(exit_code=code, outcome=exitcodes.describe(code), reason=reason, step=step)
        if journal_here is None:
            self.record(journal.SEGMENT_END, **fields)
        elif journal_here:
            self.journal.append(journal.SEGMENT_END, rank=self.env.rank, **fields)
        if barrier is not None:
            barrier()

    def end(self, code: int, reason: str, *, step: int | None = None,
            barrier: Callable[[], None] | None = None, announce: str = "every rank") -> NoReturn:
        """Journal ``segment_end`` (rank 0), wait for every rank, and exit with ``code``.

        The barrier keeps the other ranks alive until rank 0's line is durable: torchrun tears
        down all workers as soon as one exits non-zero.
        """
        self.finish(code, reason, step=step, barrier=barrier, announce=announce)
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(code)


def preflight(run_dir: RunDir, *, min_free_gb: float) -> list[str]:
    """Problems that make this node unfit to join the job (empty list = fit).

    Run once per node by the sbatch template before rendezvous: the run directory is writable
    from here, it has ``min_free_gb`` free, and torch imports (remembered on the node between
    starts: ``slurmft.train.torch_check``).
    """
    problems = []
    try:
        check_run_dir_writable(run_dir)
    except RunDirError as exc:
        return [f"run-dir: {exc}"]
    try:
        stat = os.statvfs(run_dir.root)
    except OSError as exc:
        problems.append(f"disk: cannot stat {run_dir.root}: {exc.strerror}")
    else:
        free_gb = stat.f_bavail * stat.f_frsize / 2**30
        if free_gb < min_free_gb:
            problems.append(f"disk: {run_dir.root} has {free_gb:.1f} GiB free, below {min_free_gb:g} GiB")
    problem = torch_check.check()
    if problem is not None:
        problems.append(f"python: {problem}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """``python -m slurmft.train.runtime preflight RUN_DIR``: one line per node, rc 1 when unfit."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m slurmft.train.runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preflight", help="check that this node can join the training job")
    pre.add_argument("run_dir", type=Path)
    pre.add_argument("--min-free-gb", type=float, default=1.0)
    args = parser.parse_args(argv)
    env = JobEnv.from_environ()
    problems = preflight(RunDir(args.run_dir), min_free_gb=args.min_free_gb)
    for problem in problems:
        print(f"FAIL {env.node} {problem}", flush=True)
    if not problems:
        print(f"OK {env.node}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
