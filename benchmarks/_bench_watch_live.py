"""The live part of watch_scale_bench.py: one watcher (``--user $USER --all``) over N real run dirs
with beating writers on the local disk and N jobs on a devcluster's controller.

The jobs are held (``sbatch --hold``): the devcluster's few nodes could not run a thousand jobs,
and a queued job costs the watcher what it costs on a real cluster (the controller lists it, the
watcher reads its run dir). The run dirs look like a training run's: a journal with a segment
start and losses, and a heartbeat per node that a writer process (the real ``Heartbeat`` writer,
atomic and fsynced) replaces every ``beat_s`` seconds, spread over the period, with a loss line
per beat. The watcher is the real one, built as ``slurmft watch --user $USER --all`` builds it,
stepped cycle by cycle in this process so that its CPU time, its controller calls (every command
its Slurm client runs) and its filesystem calls (``_fs_ops.FsOps``) can be counted per cycle.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _fs_ops import FsOps

from slurmft import journal
from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.devcluster import DevCluster
from slurmft.watch.config import WatchConfig
from slurmft.watch.loop import Watcher
from slurmft.watch.resolve import current_user
from slurmft.watch.filecache import RACY_S

SCRIPT = "#!/bin/bash\n#SBATCH --requeue\nsleep 1\n"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _cpu() -> tuple[float, float]:
    """(this process's CPU seconds, its finished children's: the squeue/scontrol it ran)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def _writers(dirs: list[str], ids: list[str], nodes: int, beat_s: float, paused, stop) -> None:
    """The beating writers: every run's every node beats once per ``beat_s``, spread evenly."""
    from slurmft.train.heartbeat import Heartbeat

    beats = [[Heartbeat(RunDir(Path(d)), f"node{k:02d}", job_id=job, restart_count=0, interval_s=0)
              for k in range(nodes)] for d, job in zip(dirs, ids)]
    step = [100] * len(dirs)
    gap = beat_s / max(len(dirs), 1)
    i = 0
    while not stop.is_set():
        if paused.is_set():
            time.sleep(0.05)
            continue
        step[i] += 10
        for hb in beats[i]:
            hb.beat(step[i], force=True)
        journal.append_event(RunDir(Path(dirs[i])).events, journal.LOSS, job_id=ids[i],
                             restart_count=0, step=step[i], loss=1.0)
        i = (i + 1) % len(dirs)
        time.sleep(gap)


class Counting:
    """Counts every command the Slurm client runs (one controller call each)."""

    def __init__(self, client: CliSlurmClient) -> None:
        self.calls = 0
        self.by_command: dict[str, int] = {}
        real = client._run

        def run(argv, **kwargs):
            self.calls += 1
            key = " ".join(argv[:2]) if argv and argv[0] == "scontrol" else (argv[0] if argv else "")
            self.by_command[key] = self.by_command.get(key, 0) + 1
            return real(argv, **kwargs)
        client._run = run  # type: ignore[method-assign]


def _measure(watcher: Watcher, counting: Counting, runs_root: Path, cycles: int, spacing_s: float,
             n: int) -> dict[str, Any]:
    calls0 = counting.calls
    cpu, kids, wall = 0.0, 0.0, 0.0
    with FsOps(runs_root) as ops:
        for _ in range(cycles):
            time.sleep(spacing_s)
            c0, k0, w0 = *_cpu(), time.monotonic()
            watcher.cycle()
            c1, k1, w1 = *_cpu(), time.monotonic()
            cpu, kids, wall = cpu + c1 - c0, kids + k1 - k0, wall + w1 - w0
    return {"cycles": cycles, "controller_calls_per_cycle": (counting.calls - calls0) / cycles,
            "cpu_s_per_cycle": cpu / cycles, "squeue_cpu_s_per_cycle": kids / cycles,
            "wall_s_per_cycle": wall / cycles,
            "fs_ops_per_run_cycle": ops.metadata_ops / (n * cycles),
            "fs_ops_by_kind_per_run_cycle": {k: v / (n * cycles) for k, v in sorted(ops.counts.items())},
            "bytes_read_per_run_cycle": ops.bytes_read / (n * cycles)}


def live(work: Path, n: int, nodes_per_run: int, beat_s: float, cycles: int, memory_cycles: int,
         spacing_s: float) -> dict[str, Any]:
    from slurmft.commands.watch import RunFactory

    logging.getLogger("slurmft").setLevel(logging.ERROR)  # not a line per adopted job
    cluster_dir = Path(tempfile.mkdtemp(prefix="wsb-"))  # short: the cluster's socket paths
    try:
        cluster = DevCluster.up(cluster_dir / "cluster", nodes=2)
    except BaseException:
        shutil.rmtree(cluster_dir, ignore_errors=True)
        raise
    ctx = multiprocessing.get_context("spawn")
    paused, stop = ctx.Event(), ctx.Event()
    writer = None
    try:
        runs_root = work / "runs"
        script = work / "job.sh"
        script.write_text(SCRIPT)
        dirs, ids = [], []
        submit_started = time.monotonic()
        for i in range(n):
            rd = RunDir(runs_root / f"run{i:04d}")
            rd.root.mkdir(parents=True)
            out = subprocess.run(["sbatch", "--parsable", "--hold", "-J", f"scale{i}", "-N1",
                                  "-o", "/dev/null", f"--comment=SLURMFT_RUN_DIR={rd.root}", str(script)],
                                 env={**os.environ, **cluster.env}, capture_output=True, text=True,
                                 timeout=60, cwd=work, check=True).stdout.strip()
            job_id = out.split(";")[0]
            journal.append_event(rd.events, journal.SEGMENT_START, job_id=job_id, restart_count=0,
                                 world_size=8 * nodes_per_run, num_nodes=nodes_per_run)
            for step in range(10, 110, 10):
                journal.append_event(rd.events, journal.LOSS, job_id=job_id, restart_count=0,
                                     step=step, loss=1.0)
            dirs.append(str(rd.root))
            ids.append(job_id)
        submit_s = time.monotonic() - submit_started
        log(f"{n} jobs submitted in {submit_s:.0f} s; first cycle (adopting every run)")
        writer = ctx.Process(target=_writers, args=(dirs, ids, nodes_per_run, beat_s, paused, stop),
                             daemon=True)
        writer.start()
        client = CliSlurmClient(env=cluster.env)
        counting = Counting(client)
        cfg = WatchConfig()
        factory = RunFactory(client, cfg, [], None, None)
        watcher = Watcher(client, [], poll_s=cfg.poll_s, user=current_user(), adopt=factory.adopt,
                          let_go=factory.let_go)
        c0, w0 = _cpu()[0], time.monotonic()
        watcher.cycle()
        first = {"controller_calls": counting.calls, "cpu_s": _cpu()[0] - c0,
                 "wall_s": time.monotonic() - w0, "runs_watched": len(watcher.runs)}
        log(f"first cycle: {first['controller_calls']} controller calls, {first['wall_s']:.0f} s")
        settle = 0
        while settle < 12:  # submissions captured (accounting may lag): then a cycle is one query
            before = counting.calls
            watcher.cycle()
            settle += 1
            if counting.calls - before <= 1:
                break
        paused.set()
        time.sleep(RACY_S + 1.0)  # the writers' last files settle
        watcher.cycle()
        idle = _measure(watcher, counting, runs_root, cycles, spacing_s, n)
        log(f"idle: {idle['controller_calls_per_cycle']:.2f} calls, {idle['cpu_s_per_cycle']:.3f} s CPU, "
            f"{idle['fs_ops_per_run_cycle']:.2f} fs ops per run per cycle")
        paused.clear()
        beating = _measure(watcher, counting, runs_root, cycles, spacing_s, n)
        log(f"beating: {beating['fs_ops_per_run_cycle']:.2f} fs ops per run per cycle; "
            f"memory over {memory_cycles} cycles")
        memory = _memory(watcher, client, memory_cycles)
        return {"runs": n, "nodes_per_run": nodes_per_run, "beat_s": beat_s,
                "slurm_version": ".".join(map(str, cluster.slurm_version)), "submit_s": submit_s,
                "first_cycle": first, "settle_cycles": settle, "idle": idle, "beating": beating,
                "memory": memory, "commands": counting.by_command}
    finally:
        stop.set()
        if writer is not None:
            writer.join(timeout=10)
            if writer.is_alive():
                writer.kill()
        cluster.down()
        shutil.rmtree(cluster_dir, ignore_errors=True)


def _memory(watcher: Watcher, client: CliSlurmClient, cycles: int) -> dict[str, Any]:
    """RSS over ``cycles`` back-to-back cycles against a recorded answer of the real controller
    (the last ``squeue``, replayed: a thousand squeue calls a second would measure slurmctld)."""
    jobs, nodes = client.user_jobs(current_user()), client.nodes()
    client.user_jobs = lambda user: dict(jobs)  # type: ignore[method-assign]
    client.nodes = lambda names=None: dict(nodes)  # type: ignore[method-assign]
    warm = max(cycles // 10, 1)
    samples: list[tuple[int, int]] = []
    started = time.monotonic()
    for i in range(1, cycles + 1):
        watcher.cycle()
        if i == warm or i == cycles or i % max(cycles // 10, 1) == 0:
            gc.collect()
            samples.append((i, _rss_kib()))
            log(f"memory: cycle {i}, RSS {samples[-1][1]} KiB")
    base = next(rss for i, rss in samples if i == warm)
    end = samples[-1][1]
    return {"cycles": cycles, "answers": "recorded (the real controller's last squeue answer)",
            "rss_kib_after_warmup": base, "rss_kib_end": end, "growth_ratio": end / base if base else None,
            "samples": samples, "wall_s": time.monotonic() - started}
