"""The demo's second part (issue 27): the same node death, recovered inside the allocation by a
hot spare instead of by a requeue.

A second run on the same devcluster, once the first has finished: ``sbatch --nodes=3 --no-kill``
with ``SLURMFT_SPARE_NODES=1`` (2 nodes train, 1 waits with its torchrun agent started), and
``slurmft watch`` beside it as a user would run it. After a checkpoint, a training node other than
the batch host dies (its slurmd and every process on it SIGKILLed); the launcher fences it, the
spare takes its place, the ranks restore the newest checkpoint and go on on 2 nodes. Checked: the
recovery happened in the allocation (the job's restart count is still 0, it is RUNNING), the dead
node is fenced and not among the active nodes, and, once the run finished, every step's loss
equals the uninterrupted run's bit for bit (same world size: the spare keeps it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

from slurmft.chaos import faults
from slurmft.chaos.drive import ChaosError, ChaosRun, Outcome, outcome_problems
from slurmft.chaos.faults import Target
from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import JobState
from slurmft.slurm.devcluster import DevCluster

SPARES = 1
TRAINING_NODES = 2  # the main run's world size: one uninterrupted run is the reference of both
FAULT_TIMEOUT_S = 240
PROGRESS_TIMEOUT_S = 300
FINISH_TIMEOUT_S = 600


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


class SpareDemo:
    def __init__(self, work: Path, cluster: DevCluster, client: CliSlurmClient, console: Console,
                 template: Path, script: Path, train_args: list[str], job_env: dict[str, str],
                 watch_args: list[str]) -> None:
        self.work, self.cluster, self.client, self.console = work, cluster, client, console
        self.template, self.script, self.train_args = template, script, train_args
        self.job_env, self.watch_args = job_env, watch_args
        self.run_dir = RunDir(work / "run-spare")
        self.job_id: str | None = None
        self.watcher: subprocess.Popen | None = None

    def _alive(self) -> str | None:
        if self.watcher is not None and self.watcher.poll() is not None:
            return (f"slurmft watch exited with {self.watcher.returncode} "
                    f"(see {self.work / 'watch-spare.log'} and {self.work / 'job-spare.log'})")
        return None

    def run(self) -> tuple[Outcome, list[str]]:
        """Submit, kill a training node, wait for the run to finish; the outcome and problems."""
        self.run_dir.root.mkdir(parents=True)
        env = {**os.environ, **self.cluster.env, **self.job_env,
               "SLURMFT_RUN_DIR": str(self.run_dir.root), "SLURMFT_SPARE_NODES": str(SPARES)}
        nodes = TRAINING_NODES + SPARES
        self.job_id = self.client.submit(
            self.template, [str(self.script), *self.train_args], env=env,
            sbatch_options=[f"--nodes={nodes}", "--no-kill", f"--output={self.work / 'job-spare.log'}",
                            f"--chdir={self.work}"])
        self.console.print(f"[bold]job {self.job_id}[/]: SLURMFT_SPARE_NODES={SPARES} sbatch "
                           f"--nodes={nodes} --no-kill train.sbatch train_gpt.py (in-allocation "
                           f"mode: {TRAINING_NODES} nodes train, {SPARES} waits as a hot spare)")
        with open(self.work / "watch-spare.log", "ab") as log:
            self.watcher = subprocess.Popen(
                [sys.executable, "-m", "slurmft.cli", "watch", self.job_id, *self.watch_args, "-v"],
                env={**os.environ, **self.cluster.env}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        target = Target(self.cluster, self.client, self.job_id, self.run_dir, self.script, self.work)
        chaos = ChaosRun(target, alive=self._alive)
        with self.console.status("training until a checkpoint, then a node death"):
            ckpt = chaos.wait_progress(PROGRESS_TIMEOUT_S)
        with self.console.status("node death: waiting for the launcher and the spare"):
            outcome = chaos.inject(faults.NODE_DEATH, FAULT_TIMEOUT_S)
        job = self.client.job(self.job_id)
        self.console.print(f"[bold red]node death[/] after checkpoint {ckpt}: {outcome.detail}")
        wrong = outcome_problems(outcome)
        if outcome.where != "allocation" or job.restart_count != 0:
            wrong.append(f"recovered by {outcome.where} (restart count {job.restart_count}), "
                         "not inside the allocation")
        if job.state is not JobState.RUNNING:
            wrong.append(f"the job is {job.state.value}, not RUNNING")
        colour = "red" if wrong else "green"
        self.console.print(f"  [dim]evidence: {outcome.evidence}[/]")
        self.console.print(
            f"  [{colour}]detected as {outcome.detected_as} after {_secs(outcome.detect_s)}[/], "
            f"training again after {_secs(outcome.back_s)} from step {outcome.resumed_step} on "
            f"{outcome.world_size} ranks ({', '.join(outcome.nodes) or '?'})")
        self.console.print(f"  the job: {job.state.value}, restart count {job.restart_count} "
                           f"(recovered {'inside its allocation' if outcome.where == 'allocation' else 'by ' + outcome.where}); "
                           f"steps lost: {outcome.lost_steps}")
        for w in wrong:
            self.console.print(f"  [red]wrong:[/] {w}")
        for problem in chaos.repair():
            self.console.print(f"  [yellow]repair failed:[/] {problem}")
        self._finish()
        return outcome, [f"node death (spare): {w}" for w in wrong]

    def _finish(self) -> None:
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        with self.console.status("training the spare run to its last step"):
            while not self.run_dir.done.exists():
                problem = self._alive()
                if problem:
                    raise ChaosError(f"while waiting for the spare run to finish: {problem}")
                if time.monotonic() > deadline:
                    raise ChaosError(f"timed out after {FINISH_TIMEOUT_S} s waiting for the spare "
                                     "run to finish (DONE)")
                time.sleep(1)
        self.stop_watcher()
        self.console.print("[bold green]spare run finished[/]")

    def stop_watcher(self, wait_s: float = 60) -> None:
        if self.watcher is None or self.watcher.poll() is not None:
            return
        try:
            self.watcher.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.watcher.terminate()
            try:
                self.watcher.wait(10)
            except subprocess.TimeoutExpired:
                self.watcher.kill()
                self.watcher.wait(10)


def side_by_side(requeue: Outcome | None, spare: Outcome, secs: Callable = _secs) -> Table:
    table = Table(title="one node death, two ways to recover (seconds after the fault)")
    for column in ("recovered by", "detected as", "detected", "running", "training", "resumed at",
                   "steps lost", "ranks"):
        table.add_column(column, justify="left" if column in ("recovered by", "detected as") else "right")
    for label, o in (("requeue (slurmft watch)", requeue), ("hot spare (in the allocation)", spare)):
        if o is None:
            continue
        table.add_row(label, o.detected_as or "-", secs(o.detect_s), secs(o.running_s),
                      secs(o.back_s), str(o.resumed_step), str(o.lost_steps), str(o.world_size))
    return table
