"""`make demo`: the whole promise of slurmft, end to end, on a throwaway Slurm cluster on this machine.

1. `slurmft devcluster up`: munge, MariaDB + slurmdbd, slurmctld and 4 slurmd on 127.0.0.1.
2. examples/train_gpt.py (FSDP2, gloo) submitted through sbatch_templates/train.sbatch with a node
   range (--nodes=2-3: it starts on 2 nodes), and `slurmft watch JOB` beside it.
3. One fault after another, each once the run has committed a checkpoint since the last one:
   a node death, a hang, a crash, a corrupted newest checkpoint, the time-limit signal, and a
   failing health check that the sweeper finds on an allocated node. The watcher does every
   requeue, exclusion and `StartTime=now`; this script only breaks things, then repairs the cluster
   as an admin would (the dead node restarted, the failing check fixed and the sweeper run again).
4. `slurmft status`: the timeline, what each fault cost and ETTR, and a PNG of the timeline.
5. The finished run against an uninterrupted run of the same steps on the same number of ranks:
   every step trained on that many ranks has the same loss bit for bit.
6. In-allocation recovery (issue 27; `examples/demo_spare.py`, skipped with --no-spare): a second,
   shorter run with one hot spare (`SLURMFT_SPARE_NODES=1 sbatch --nodes=3 --no-kill`); the same
   node death is recovered inside the allocation, the job never leaving RUNNING; shown beside the
   requeue's, and its losses compared with the uninterrupted run's too.
7. The cluster is torn down, also on failure or Ctrl-C.

Run as root after `make install`:  make demo   (DEMO_DIR=... keeps the files somewhere known)
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slurmft import journal
from slurmft.chaos import faults
from slurmft.chaos.drive import ChaosError, ChaosRun, Outcome, outcome_problems
from slurmft.chaos.faults import FaultError, Target
from slurmft.chaos.reference import ReferenceRunError, uninterrupted_run
from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import SlurmError
from slurmft.slurm.devcluster import DevCluster, DevClusterError

from demo_spare import SpareDemo, side_by_side  # examples/ (this script's directory)

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "sbatch_templates" / "train.sbatch"
SCRIPT = REPO / "examples" / "train_gpt.py"
NODES = 4
# Slurm gives a node range its minimum when that many nodes are free (measured here: --nodes=2-3 on
# 4 idle nodes ran on 2): 2-3 starts on 2, and the run keeps 2 ranks when the watcher can find 2.
# Two, not three: every requeue starts each node's pre-flight, torchrun agent and rank again (seven
# starts in all), and the third node's share was ~1/4 of the demo's CPU; no fault needs a third
# node (a node death kills the one training node that is not the batch host).
JOB_NODES = "2-3"
ORDER = (faults.NODE_DEATH, faults.HANG, faults.CRASH, faults.CORRUPT_NEWEST, faults.TIME_LIMIT,
         faults.UNHEALTHY_NODE)
# Small and deterministic: 2 cores run every rank. The in-job step watchdog is set far beyond the
# watcher's hang timeout so that the hang is the watcher's to find (from the heartbeats). The hang
# timeout is well above the ~28 s the controller took here to call a dead node DOWN
# (SlurmdTimeout=10): a node death is then found as one, and the dead node excluded, before the
# stopped heartbeats would make it a hang that names no node.
TRAIN_ARGS = ["--tiny", "--global-batch", "12", "--heartbeat-interval", "0.5", "--ckpt-every", "5",
              "--step-sleep", "0.25", "--watchdog-timeout", "600"]
# The uninterrupted run's: the same less the step sleep and the checkpoints, which change no loss
# while the guard does not trip (a job rolls back there, a run without checkpoints skips)
# (80 steps' sleep was 20 s of the demo's wall, more on a loaded box; its 16 saves ~10 % of its CPU).
_NOT_IN_REFERENCE = ("--step-sleep", "--ckpt-every")  # each with its value
REFERENCE_ARGS = [a for i, a in enumerate(TRAIN_ARGS) if a not in _NOT_IN_REFERENCE
                  and (i == 0 or TRAIN_ARGS[i - 1] not in _NOT_IN_REFERENCE)]
HANG_TIMEOUT_S = 45
WATCH_ARGS = ["--poll", "1", "--hang-timeout", str(HANG_TIMEOUT_S)]
# Every loss line reaches the journal at once, so that the display follows each step.
JOB_ENV = {"OMP_NUM_THREADS": "1", "SLURMFT_PYTHON": sys.executable,
           "SLURMFT_JOURNAL_FLUSH_EVERY_EVENTS": "1"}
FAULT_TIMEOUT_S = 240
MIN_STEPS = 60
SPARE_STEPS = 40  # the spare run's; a step's loss does not depend on the run's length
PROGRESS_TIMEOUT_S = 180
WATCHER_STOP_S = 10


class Interrupted(BaseException):
    """SIGINT or SIGTERM: tear down and leave (a BaseException: no ``except Exception`` on the
    way, a failed repair's included, may swallow it)."""


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


class Demo:
    def __init__(self, work: Path, steps: int, console: Console) -> None:
        self.work = work
        self.steps = steps
        self.console = console
        self.run_dir = RunDir(work / "run")
        self.cluster: DevCluster | None = None
        self.watcher: subprocess.Popen | None = None
        self.job_id: str | None = None
        self.client: CliSlurmClient | None = None
        self.spare: SpareDemo | None = None
        self._reference: dict[int, dict[int, journal.Event]] = {}

    # -- the parts -----------------------------------------------------------------------
    def up(self) -> None:
        with self.console.status(f"starting a {NODES}-node devcluster in {self.work / 'cluster'}"):
            self.cluster = DevCluster.up(self.work / "cluster", nodes=NODES)
        self.client = CliSlurmClient(env=self.cluster.env)
        nodes = ", ".join(self.cluster.node_names)
        self.console.print(f"[bold]devcluster[/] {self.cluster.cluster_name}: Slurm "
                           f"{'.'.join(map(str, self.cluster.slurm_version))}, nodes {nodes}")

    def submit(self) -> None:
        assert self.cluster is not None and self.client is not None
        self.run_dir.root.mkdir(parents=True)
        env = {**os.environ, **self.cluster.env, **JOB_ENV, "SLURMFT_RUN_DIR": str(self.run_dir.root)}
        self.job_id = self.client.submit(
            TEMPLATE, [str(SCRIPT), *TRAIN_ARGS, "--steps", str(self.steps)], env=env,
            sbatch_options=[f"--nodes={JOB_NODES}", f"--output={self.work / 'job.log'}",
                            f"--chdir={self.work}"])
        self.console.print(f"[bold]job {self.job_id}[/]: sbatch --nodes={JOB_NODES} train.sbatch "
                           f"train_gpt.py --steps {self.steps} (checkpoint every 5 steps)")
        # The job names it after its pre-flight, whose own bound is 180 s: a liveness bound above
        # that (120 s failed the demo on a loaded 2-core box while the pre-flight still ran).
        bound_s = 300
        deadline = time.monotonic() + bound_s
        with self.console.status("waiting for the job to name its run dir (job comment)"):
            while self.client.job(self.job_id).run_dir is None:
                if time.monotonic() > deadline:
                    raise ChaosError(f"job {self.job_id} did not name its run dir within {bound_s} s")
                time.sleep(0.5)

    def watch(self) -> None:
        assert self.cluster is not None and self.job_id is not None
        log = open(self.work / "watch.log", "ab")
        # Its own session: Ctrl-C in the terminal reaches this script, which stops the watcher.
        self.watcher = subprocess.Popen(
            [sys.executable, "-m", "slurmft.cli", "watch", self.job_id, *WATCH_ARGS, "-v"],
            env={**os.environ, **self.cluster.env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        self.console.print(f"[bold]slurmft watch {self.job_id}[/] {' '.join(WATCH_ARGS)} "
                           f"(log: {self.work / 'watch.log'})")

    def _alive(self) -> str | None:
        # The job itself may show FAILED for a moment between a crash and the watcher's requeue:
        # only the watcher's exit (the run finished, or it gave up and held the job) ends a wait.
        if self.watcher is not None and self.watcher.poll() is not None:
            return (f"slurmft watch exited with {self.watcher.returncode} "
                    f"(see {self.work / 'watch.log'} and {self.work / 'job.log'})")
        return None

    def chaos(self) -> tuple[list[Outcome], list[str]]:
        assert self.cluster is not None and self.client is not None and self.job_id is not None
        target = Target(self.cluster, self.client, self.job_id, self.run_dir, SCRIPT, self.work)
        run = ChaosRun(target, alive=self._alive)
        outcomes, problems = [], []
        for number, fault in enumerate(ORDER, 1):
            with self.console.status(f"training until a new checkpoint, then fault {number}/"
                                     f"{len(ORDER)}: {fault.name}"):
                ckpt = run.wait_progress(PROGRESS_TIMEOUT_S)
            with self.console.status(f"{fault.name}: waiting for the watcher and the run"):
                outcome = run.inject(fault, FAULT_TIMEOUT_S)
            self.console.print(f"[bold red]fault {number}: {fault.name}[/] after checkpoint {ckpt}: "
                               f"{outcome.detail}")
            wrong = outcome_problems(outcome)
            # Found within the hang timeout + 2 poll cycles + a heartbeat period of the stop.
            if fault is faults.HANG and (outcome.detect_s or 1e9) > HANG_TIMEOUT_S + 5:
                wrong.append(f"found {_secs(outcome.detect_s)} after the stop")
            problems += [f"{fault.name}: {w}" for w in wrong]
            colour = "red" if wrong else "green"
            self.console.print(f"  [dim]evidence: {outcome.evidence}[/]")
            self.console.print(
                f"  [{colour}]detected as {outcome.detected_as} after {_secs(outcome.detect_s)}[/], "
                f"running again after {_secs(outcome.running_s)}, training again after "
                f"{_secs(outcome.back_s)} from step {outcome.resumed_step} on "
                f"{outcome.world_size} ranks ({', '.join(outcome.nodes) or '?'}); "
                f"steps lost: {outcome.lost_steps}")
            for w in wrong:
                self.console.print(f"  [red]wrong:[/] {w}")
            for problem in run.repair():
                self.console.print(f"  [yellow]repair failed:[/] {problem}")
            outcomes.append(outcome)
        return outcomes, problems

    def finish(self) -> None:
        assert self.watcher is not None
        deadline = time.monotonic() + 600
        with self.console.status(f"training to step {self.steps}"):
            while not self.run_dir.done.exists():
                problem = self._alive()
                if problem:
                    raise ChaosError(f"while waiting for the run to finish: {problem}")
                if time.monotonic() > deadline:
                    raise ChaosError("timed out after 600 s waiting for the run to finish (DONE)")
                time.sleep(1)
        try:
            self.watcher.wait(60)
        except subprocess.TimeoutExpired:
            raise ChaosError("slurmft watch did not exit within 60 s of the run finishing") from None
        self.console.print(f"[bold green]run finished[/]; slurmft watch exited {self.watcher.returncode}")

    def status(self) -> Path:
        png = self.work / "timeline.png"
        self.console.rule("slurmft status")
        res = subprocess.run([sys.executable, "-m", "slurmft.cli", "status", str(self.run_dir.root),
                              "--no-slurm", "--plot", str(png)],
                             env={**os.environ, "COLUMNS": os.environ.get("COLUMNS", "150")},
                             timeout=120, check=False)
        if res.returncode != 0:
            raise ChaosError(f"slurmft status exited {res.returncode}")
        return png

    def spare_part(self, requeued: list[Outcome]) -> list[str]:
        """The same node death recovered by a hot spare; problems found (empty: none)."""
        assert self.cluster is not None and self.client is not None
        self.console.rule("in the allocation: a hot spare")
        self.spare = SpareDemo(self.work, self.cluster, self.client, self.console, TEMPLATE, SCRIPT,
                               [*TRAIN_ARGS, "--steps", str(SPARE_STEPS)], JOB_ENV, WATCH_ARGS)
        outcome, problems = self.spare.run()
        node_death = next((o for o in requeued if o.fault == faults.NODE_DEATH.name), None)
        self.console.print(side_by_side(node_death, outcome, _secs))
        return problems + self.compare(self.spare.run_dir, SPARE_STEPS)

    def reference(self, size: int) -> dict[int, journal.Event]:
        """The uninterrupted run's losses on ``size`` ranks (run once per size)."""
        if size not in self._reference:
            with self.console.status(f"an uninterrupted run of {self.steps} steps on {size} ranks"):
                ref_events = uninterrupted_run(self.work / f"reference-{size}", SCRIPT,
                                               [*REFERENCE_ARGS, "--steps", str(self.steps)], size,
                                               env=JOB_ENV, timeout=300)
            self._reference[size] = {e.get("step"): e for e in ref_events if e.kind == journal.LOSS}
        return self._reference[size]

    def compare(self, run_dir: RunDir | None = None, steps: int | None = None) -> list[str]:
        """Problems found comparing a run (default: the main one) with an uninterrupted one."""
        run_dir = run_dir or self.run_dir
        steps = steps or self.steps
        events = read_events(run_dir.events)
        final: dict[int, journal.Event] = {}
        for event in events:
            if event.kind == journal.LOSS:
                final[event.get("step")] = event  # a redone step: its last run is the one kept
        sizes = collections.Counter(e.get("world_size") for e in final.values())
        size = sizes.most_common(1)[0][0]
        ref = self.reference(size)
        problems = []
        missing = sorted(set(range(1, steps + 1)) - set(final))
        if missing:
            problems.append(f"steps never trained: {missing}")
        same = [s for s, e in final.items() if e.get("world_size") == size]
        differ = [s for s in same if (final[s].get("loss"), final[s].get("samples")) !=
                  (ref[s].get("loss"), ref[s].get("samples"))]
        samples = [s for s in final if final[s].get("samples") != ref[s].get("samples")]
        if differ:
            problems.append(f"steps on {size} ranks whose loss differs from the uninterrupted "
                            f"run's: {differ}")
        if samples:
            problems.append(f"steps that saw other samples than the uninterrupted run: {samples}")
        diverged = [e.get("step") for e in events if e.kind == journal.RESUME_DIVERGED]
        if diverged:
            problems.append(f"redone steps whose loss changed: {diverged}")
        others = {k: v for k, v in sizes.items() if k != size}
        self.console.print(
            f"{len(same)} steps trained on {size} ranks: {len(same) - len(differ)} have the loss of "
            f"the uninterrupted run bit for bit; every step saw the same samples: "
            f"{'no' if samples else 'yes'}" + (f"; steps on other world sizes {dict(others)} "
                                               "(other reduction order, compared by samples)"
                                               if others else ""))
        return problems

    def table(self, outcomes: list[Outcome]) -> Table:
        table = Table(title="what each fault cost (seconds after the fault)")
        for column in ("fault", "detected as", "detected", "running", "training", "resumed at",
                       "steps lost", "ranks"):
            table.add_column(column, justify="left" if column in ("fault", "detected as") else "right")
        for o in outcomes:
            table.add_row(o.fault, o.detected_as or "-", _secs(o.detect_s), _secs(o.running_s),
                          _secs(o.back_s), str(o.resumed_step), str(o.lost_steps), str(o.world_size))
        return table

    def down(self) -> None:
        try:
            if self.spare is not None:
                self.spare.stop_watcher(wait_s=0)
            if self.watcher is not None and self.watcher.poll() is None:
                self.watcher.terminate()
                try:
                    self.watcher.wait(WATCHER_STOP_S)
                except subprocess.TimeoutExpired:
                    self.watcher.kill()
                    self.watcher.wait(WATCHER_STOP_S)
        finally:
            cluster = self.cluster
            if cluster is None and (self.work / "cluster" / "devcluster.json").exists():
                # Interrupted inside `up` (its own clean-up may have been cut short too).
                cluster = DevCluster.attach(self.work / "cluster", running=False)
            if cluster is not None:
                with self.console.status("tearing the devcluster down"):
                    cluster.down()
                self.console.print("devcluster down: no daemon, job process or /etc/hosts line left")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=os.environ.get("DEMO_DIR") or None,
                   help="where the cluster, the run and the logs go (default: a new temp dir)")
    # argparse converts a string default with `type`: DEMO_STEPS=abc is a one-line usage error.
    p.add_argument("--steps", type=int, default=os.environ.get("DEMO_STEPS", "80"),
                   help=f"steps of the run (at least {MIN_STEPS}: six faults need room)")
    p.add_argument("--no-spare", dest="spare", action="store_false",
                   help="skip the second part: a node death recovered by a hot spare (issue 27)")
    args = p.parse_args(argv)
    if args.steps < MIN_STEPS:
        p.error(f"--steps {args.steps}: at least {MIN_STEPS} (six faults, each after a new checkpoint)")
    console = Console(width=None if sys.stdout.isatty() else 130)
    if os.geteuid() != 0:
        console.print("demo: must run as root (it starts Slurm daemons)", style="red")
        return 1
    work = (args.dir or Path(tempfile.mkdtemp(prefix="slurmft-demo."))).absolute()
    try:
        work.mkdir(parents=True, exist_ok=True)
        empty = not any(work.iterdir())
    except OSError as exc:
        console.print(f"demo: --dir {work}: {exc.strerror}", style="red")
        return 1
    if not empty:
        console.print(f"demo: {work} is not empty; give an empty or new --dir", style="red")
        return 1
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    demo = Demo(work, args.steps, console)
    started = time.monotonic()
    code = 1
    try:
        demo.up()
        demo.submit()
        demo.watch()
        outcomes, problems = demo.chaos()
        demo.finish()
        console.print(demo.table(outcomes))
        png = demo.status()
        problems += demo.compare()
        if args.spare:
            problems += demo.spare_part(outcomes)
        for problem in problems:
            console.print(f"[red]FAILED:[/] {problem}")
        if not problems:
            if args.spare:
                console.print("[bold green]in the allocation:[/] a node death recovered by a hot "
                              "spare, the job never requeued")
            console.print(f"[bold green]demo passed[/] in {time.monotonic() - started:.0f} s: "
                          f"{len(outcomes)} faults, each recovered by slurmft watch without a "
                          f"human; timeline: {png}")
            code = 0
    except Interrupted as why:
        console.print(f"[yellow]interrupted ({why}): tearing down[/]")
        code = 130
    except (ChaosError, FaultError, ReferenceRunError, DevClusterError, SlurmError) as exc:
        console.print(f"[red]demo failed:[/] {exc}")
    finally:
        # Nothing may cut the teardown short: a second Ctrl-C waits for it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            demo.down()
        except (DevClusterError, OSError, subprocess.SubprocessError) as exc:
            console.print(f"[red]teardown failed:[/] {exc}")
            code = code or 1
        console.print(f"files: {work} (job log: {work / 'job.log'}, watcher: {work / 'watch.log'})")
    return code


if __name__ == "__main__":
    sys.exit(main())
