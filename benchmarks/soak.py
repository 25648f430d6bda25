"""Chaos soak: effective training time under failure (ETTR) of one long run on its own devcluster.

    python benchmarks/soak.py [--minutes 30] [--fault-every 180] [--seed 1] [--spares K [--refill]]
        [--dir DIR] [--cpu-cap CPUS] [--json]

Brings up a 4-node devcluster (root; Debian's Slurm, slurmdbd, munge, MariaDB) and:

1. calibrates: an uninterrupted 3-rank run of examples/train_gpt.py (torchrun, no Slurm) measures
   the step time and what a checkpoint costs the loop; `slurmft interval` turns that cost and the
   fault rate into the checkpoint interval (Young/Daly), and the step count is set so that the run
   trains for about --minutes;
2. submits the run through sbatch_templates/train.sbatch on 3 nodes (--nodes=3-4; with
   --spares K: in-allocation mode, `--nodes=3+K --no-kill` and SLURMFT_SPARE_NODES=K, on a
   devcluster of 3+K+2 nodes, so that a requeue that excludes a dead node still fits; with
   --refill: SLURMFT_SPARE_REFILL=1, spares from outside the allocation once the job's own are
   used, on a devcluster of 3+K+2+REFILL_NODES nodes: every node a fault broke stays fenced) with
   `slurmft watch` beside it, and injects faults drawn at random from the six classes of
   slurmft.chaos.faults (node death, hang, failing health check, corrupted newest checkpoint,
   crash, time-limit signal), exponentially spaced with mean --fault-every seconds; a fault due
   while the run is still recovering waits until it trains again and has committed a checkpoint
   (a fault needs something to hit); a node broken by a fault is repaired after its recovery;
3. once the run finished: ETTR and checkpoint overhead from its journal (`slurmft status`'s
   report), time to recover per fault class (fault -> training again, median and max), steps lost
   per fault, and whether the final model equals that of an uninterrupted run of the same steps
   on the same number of ranks (exported weights compared tensor by tensor, and every step's loss).

--cpu-cap CPUS runs the devcluster, its job and the soak's own driver in a cgroup allowed CPUS
CPUs (root; ``benchmarks/_cpu_cap.py``), after the calibration and until the reference run: the
same load every time, e.g. `--spares 1 --minutes 4 --seed 1 --cpu-cap 0.2` with torch's
rendezvous debug log on reproduces a spare's activation under load (``benchmarks/rdzv_log.py``).

Prints markdown tables, or one JSON object with --json (ettr, faults, mttr_s_median, mttr_s_max,
lost_steps_max, ckpt_overhead, final_state_equal and the details). Exits 1 when the run did not
finish or its final state differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _cpu_cap import Cap, CapError, cap_self, check  # noqa: E402

from slurmft import journal  # noqa: E402
from slurmft.chaos import faults  # noqa: E402
from slurmft.chaos.drive import ChaosError, ChaosRun, Outcome, outcome_problems  # noqa: E402
from slurmft.chaos.faults import FaultError, Target  # noqa: E402
from slurmft.chaos.reference import ReferenceRunError, uninterrupted_run  # noqa: E402
from slurmft.journal import read_events  # noqa: E402
from slurmft.rundir import RunDir  # noqa: E402
from slurmft.slurm.cli import CliSlurmClient  # noqa: E402
from slurmft.slurm.client import SlurmError  # noqa: E402
from slurmft.slurm.devcluster import DevCluster, DevClusterError  # noqa: E402
from slurmft.status.report import build_report  # noqa: E402

TEMPLATE = REPO / "sbatch_templates" / "train.sbatch"
SCRIPT = REPO / "examples" / "train_gpt.py"
NODES, JOB_NODES, RANKS = 4, "3-4", 3
# The tiny model's own step takes a few tens of ms here; the sleep stands for a bigger model's compute, so that
# a step costs what it does on a real cluster relative to a restart. It changes no number.
STEP_SLEEP_S = 0.5
BASE_ARGS = ["--tiny", "--global-batch", "12", "--heartbeat-interval", "0.5"]
# The ranks' step watchdog. On the requeue path a hang is the watcher's (its 30 s hang timeout):
# the watchdog stays out of its way. In the allocation the job restarts a hang in place itself:
# its watchdog fires at 20 steps (a user with 30 s steps would set 10 minutes; the adaptive
# default, 10 x the median step, has a 60 s floor that is sized for real steps, not 0.5 s ones).
WATCHDOG_S = {False: 600.0, True: 10.0}
WATCH_ARGS = ["--poll", "1", "--hang-timeout", "30"]
JOB_ENV = {"OMP_NUM_THREADS": "1", "SLURMFT_PYTHON": sys.executable,
           "SLURMFT_JOURNAL_FLUSH_EVERY_EVENTS": "1"}
RECOVERY_TIMEOUT_S = 300
PROGRESS_TIMEOUT_S = 300


REFILL_NODES = 4


def job_shape(spares: int, refill: bool = False) -> tuple[int, str, list[str], dict[str, str]]:
    """Devcluster nodes, the job's --nodes, extra sbatch options and launcher settings."""
    if not spares:
        return NODES, JOB_NODES, [], {}
    if refill:
        return (RANKS + spares + 2 + REFILL_NODES, str(RANKS + spares), ["--no-kill"],
                {"SLURMFT_SPARE_NODES": str(spares), "SLURMFT_SPARE_REFILL": "1"})
    # Two nodes to spare besides: a requeue that excludes a node the launcher fenced must still
    # find RANKS + spares nodes while the sweeper's fault keeps another drained (with one, the
    # 15-minute soak of 2026-11-26 waited for ever: n1 drained, n4 excluded, 3 of the 4 needed).
    return (RANKS + spares + 2, str(RANKS + spares), ["--no-kill"],
            {"SLURMFT_SPARE_NODES": str(spares)})


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def standalone(run_dir: Path, args: list[str], timeout: float) -> list[journal.Event]:
    """An uninterrupted run on RANKS local ranks (torchrun --standalone, no Slurm)."""
    return uninterrupted_run(run_dir, SCRIPT, args, RANKS, env=JOB_ENV, timeout=timeout)


def calibrate(work: Path, fault_every: float) -> dict:
    """Step time and checkpoint cost from a short uninterrupted run; the interval from them."""
    events = standalone(work / "calibration", [*BASE_ARGS, "--steps", "40", "--ckpt-every", "5",
                                               "--watchdog-timeout", str(WATCHDOG_S[False]),
                                               "--step-sleep", str(STEP_SLEEP_S)], 300)
    times = [e.time for e in events if e.kind == journal.LOSS]
    gaps = [b - a for a, b in zip(times[5:], times[6:])]
    step_s = statistics.median(gaps)
    res = subprocess.run([sys.executable, "-m", "slurmft.cli", "interval", "--run-dir",
                          str(work / "calibration"), "--mtbf", str(fault_every), "--step-time",
                          str(step_s), "--json"], capture_output=True, text=True, timeout=60,
                         check=False)
    if res.returncode != 0:
        raise ChaosError(f"slurmft interval failed: {res.stderr.strip()}")
    interval = json.loads(res.stdout)
    return {"step_s": step_s, "ckpt_cost_s": interval["cost_s"],
            "ckpt_every": max(1, int(interval["daly_steps"])), "interval": interval}


def final_weights_equal(work: Path, run: Path, reference: Path, step: int) -> bool:
    """Both runs' checkpoints of ``step`` exported as safetensors, compared tensor by tensor."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for name, run_dir in (("run", run), ("reference", reference)):
        target = work / f"final-{name}.safetensors"
        res = subprocess.run([sys.executable, "-m", "slurmft.cli", "ckpt", "export", str(run_dir),
                              str(step), str(target), "--force"], capture_output=True, text=True,
                             timeout=300, check=False)
        if res.returncode != 0:
            raise ChaosError(f"slurmft ckpt export {run_dir} {step}: {res.stderr.strip()}")
        out[name] = load_file(str(target))
    a, b = out["run"], out["reference"]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Soak:
    def __init__(self, work: Path, minutes: float, fault_every: float, seed: int,
                 spares: int = 0, cpu_cap: float | None = None, refill: bool = False) -> None:
        self.work, self.minutes, self.fault_every = work, minutes, fault_every
        self.spares, self.cpu_cap, self.refill = spares, cpu_cap, refill
        self.cap: Cap | None = None
        self.rng = random.Random(seed)
        self.run_dir = RunDir(work / "run")
        self.cluster: DevCluster | None = None
        self.watcher: subprocess.Popen | None = None

    def _alive(self) -> str | None:
        if self.watcher is not None and self.watcher.poll() is not None:
            return f"slurmft watch exited with {self.watcher.returncode} (see {self.work}/watch.log)"
        return None

    def run(self) -> dict:
        calib = calibrate(self.work, self.fault_every)
        steps = int(self.minutes * 60 / calib["step_s"])
        args = [*BASE_ARGS, "--watchdog-timeout", str(WATCHDOG_S[self.spares > 0]),
                "--steps", str(steps), "--ckpt-every", str(calib["ckpt_every"])]
        log(f"calibrated: {calib['step_s']:.3f} s/step, checkpoint cost {calib['ckpt_cost_s']:.3f} s "
            f"-> every {calib['ckpt_every']} steps; {steps} steps")
        nodes, job_nodes, options, settings = job_shape(self.spares, self.refill)
        if self.cpu_cap is not None:
            self.cap = cap_self(self.cpu_cap, f"slurmft-soak-{os.getpid()}")
            log(f"the devcluster, its job and this driver are capped at {self.cpu_cap} CPU "
                f"({self.cap.path})")
        self.cluster = DevCluster.up(self.work / "cluster", nodes=nodes)
        client = CliSlurmClient(env=self.cluster.env)
        self.run_dir.root.mkdir()
        env = {**os.environ, **self.cluster.env, **JOB_ENV, **settings,
               "SLURMFT_RUN_DIR": str(self.run_dir.root)}
        job_id = client.submit(TEMPLATE, [str(SCRIPT), *args, "--step-sleep", str(STEP_SLEEP_S)], env=env,
                               sbatch_options=[f"--nodes={job_nodes}", *options,
                                               f"--output={self.work}/job.log",
                                               f"--chdir={self.work}"])
        deadline = time.monotonic() + 120
        while client.job(job_id).run_dir is None:
            if time.monotonic() > deadline:
                raise ChaosError(f"job {job_id} did not name its run dir within 120 s")
            time.sleep(0.5)
        with open(self.work / "watch.log", "ab") as fh:
            self.watcher = subprocess.Popen(
                [sys.executable, "-m", "slurmft.cli", "watch", job_id, *WATCH_ARGS, "-v"],
                env={**os.environ, **self.cluster.env}, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True)
        target = Target(self.cluster, client, job_id, self.run_dir, SCRIPT, self.work)
        chaos = ChaosRun(target, alive=self._alive)
        started = time.monotonic()
        outcomes: list[Outcome] = []
        # Wall-clock times, as the outcomes' injection times are.
        due = time.time() + self.rng.expovariate(1 / self.fault_every)
        # Faults until the run is close to its end: one due later might find it finished.
        while True:
            trained = max((e.get("step", 0) for e in chaos.events() if e.kind == journal.LOSS),
                          default=0)
            left_s = (steps - trained) * calib["step_s"]
            if due - time.time() > left_s - 60:
                break
            chaos.wait_progress(PROGRESS_TIMEOUT_S)
            if due <= time.time():
                # Overdue (it fell due during the last recovery): not always one step after a
                # fresh checkpoint, which would flatter the steps lost; anywhere in an interval.
                due = time.time() + self.rng.uniform(0, calib["ckpt_every"] * calib["step_s"])
            time.sleep(max(0.0, due - time.time()))
            fault = self.rng.choice(faults.ALL)
            log(f"fault {len(outcomes) + 1}: {fault.name}")
            outcome = chaos.inject(fault, RECOVERY_TIMEOUT_S)
            detect = "-" if outcome.detect_s is None else f"{outcome.detect_s:.1f} s"
            log(f"  detected as {outcome.detected_as} after {detect}, training again "
                f"({outcome.where}) after {outcome.back_s:.1f} s from step {outcome.resumed_step}, "
                f"{outcome.lost_steps} steps lost")
            for problem in chaos.repair():
                log(f"  repair failed: {problem}")
            outcomes.append(outcome)
            due = outcome.injected + self.rng.expovariate(1 / self.fault_every)
        deadline = time.monotonic() + steps * calib["step_s"] + 600
        while not self.run_dir.done.exists():
            if self._alive() or time.monotonic() > deadline:
                raise ChaosError(f"the run did not finish: {self._alive() or 'timed out'}")
            time.sleep(2)
        return self.report(args, steps, calib, outcomes, time.monotonic() - started)

    def report(self, args: list[str], steps: int, calib: dict, outcomes: list[Outcome],
               wall_s: float) -> dict:
        events = read_events(self.run_dir.events)
        rep = build_report(events, now=time.time())
        if self.cap is not None:
            self.cap.release()  # the reference run is not the soak's: uncapped
        log("the uninterrupted reference run")
        ref_events = standalone(self.work / "reference", args, 1800)  # no sleep: it changes no number
        final: dict[int, journal.Event] = {}
        for e in events:
            if e.kind == journal.LOSS:
                final[e.get("step")] = e
        ref = {e.get("step"): e for e in ref_events if e.kind == journal.LOSS}
        same_ranks = [s for s, e in final.items() if e.get("world_size") == RANKS]
        loss_differs = [s for s in same_ranks
                        if (final[s].get("loss"), final[s].get("samples")) !=
                        (ref[s].get("loss"), ref[s].get("samples"))]
        other_ranks = len(final) - len(same_ranks)
        weights_equal = final_weights_equal(self.work, self.run_dir.root, self.work / "reference", steps)
        blocking = sum(e.get("blocking_s", 0.0) or 0.0 for e in events
                       if e.kind == journal.CHECKPOINT_COMMITTED)
        by_class: dict[str, list[Outcome]] = {}
        for o in outcomes:
            by_class.setdefault(o.fault, []).append(o)
        backs = [o.back_s for o in outcomes if o.back_s is not None]
        gaps = [b.injected - a.injected for a, b in zip(outcomes, outcomes[1:])]

        def cost(o: Outcome) -> float:  # training time the fault took: down time + work redone
            return (o.back_s or 0.0) + (o.lost_steps or 0) * calib["step_s"]
        return {
            "minutes": self.minutes, "fault_every_s": self.fault_every, "steps": steps,
            "spares": self.spares, "refill": self.refill, "cpu_cap": self.cpu_cap,
            "recovered_in_allocation": sum(o.where == "allocation" for o in outcomes),
            "step_s": calib["step_s"], "ckpt_cost_s": calib["ckpt_cost_s"],
            "ckpt_every_steps": calib["ckpt_every"], "wall_s": wall_s,
            "ettr": rep.ettr, "productive_s": rep.productive_s, "run_wall_s": rep.wall_s,
            "faults": len(outcomes),
            "fault_interval_s_mean": statistics.mean(gaps) if gaps else None,
            "faults_by_class": {k: len(v) for k, v in by_class.items()},
            "mttr_s_median": statistics.median(backs) if backs else None,
            "mttr_s_max": max(backs) if backs else None,
            "mttr_by_class": {k: {"median": statistics.median([o.back_s for o in v]),
                                  "max": max(o.back_s for o in v),
                                  "lost_steps_max": max(o.lost_steps or 0 for o in v),
                                  "cost_s_total": sum(cost(o) for o in v),
                                  "detected_as": sorted({str(o.detected_as) for o in v}),
                                  "where": sorted({o.where for o in v})}
                              for k, v in by_class.items()},
            "lost_steps_max": max((o.lost_steps or 0 for o in outcomes), default=0),
            "lost_steps_total": sum(o.lost_steps or 0 for o in outcomes),
            "ckpt_overhead": blocking / rep.wall_s if rep.wall_s else None,
            "ckpt_blocking_s": blocking,
            "final_state_equal": weights_equal and not loss_differs and other_ranks == 0,
            "final_weights_equal": weights_equal,
            "steps_loss_differs": loss_differs, "steps_on_other_world_sizes": other_ranks,
            "restarts_by_cause": rep.restarts_by_cause,
            "faults_detail": [{"fault": o.fault, "detected_as": o.detected_as, "detect_s": o.detect_s,
                               "running_s": o.running_s, "back_s": o.back_s,
                               "resumed_step": o.resumed_step, "lost_steps": o.lost_steps,
                               "world_size": o.world_size, "where": o.where,
                               "victim": o.victim, "nodes": o.nodes,
                               "problems": outcome_problems(o)} for o in outcomes],
        }

    def close(self) -> None:
        try:
            if self.watcher is not None and self.watcher.poll() is None:
                self.watcher.terminate()
                try:
                    self.watcher.wait(10)
                except subprocess.TimeoutExpired:
                    self.watcher.kill()
        finally:
            if self.cluster is None and (self.work / "cluster" / "devcluster.json").exists():
                self.cluster = DevCluster.attach(self.work / "cluster", running=False)
            if self.cluster is not None:
                self.cluster.down()
            if self.cap is not None:
                try:
                    self.cap.release()
                except OSError:
                    pass
                self.cap.remove()


def render(r: dict) -> str:
    def num(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)
    spares = r.get("spares", 0)
    lines = [f"# Chaos soak: {r['minutes']:g} min, one fault every {r['fault_every_s']:g} s on "
             f"average, {spares} hot spare(s)" + (" (in-allocation mode)" if spares else "")
             + (", refilled from outside the allocation" if r.get("refill") else ""), "",
             "| metric | value |", "|---|---|",
             f"| ETTR | {num(r['ettr'], '{:.3f}')} (target >= {0.95 if spares else 0.90}) |",
             f"| faults | {r['faults']} (one every {num(r['fault_interval_s_mean'], '{:.0f}')} s), "
             f"{r.get('recovered_in_allocation', 0)} recovered in the allocation |",
             f"| time to recover, median / max | {num(r['mttr_s_median'])} s / {num(r['mttr_s_max'])} s |",
             f"| steps lost, max / total | {r['lost_steps_max']} / {r['lost_steps_total']} |",
             f"| checkpoint overhead | {num(100 * r['ckpt_overhead'] if r['ckpt_overhead'] is not None else None, '{:.2f}')} % "
             f"(every {r['ckpt_every_steps']} steps, {r['step_s']:.2f} s/step, cost "
             f"{r['ckpt_cost_s']:.3f} s) |",
             f"| final state equals an uninterrupted run | {'yes' if r['final_state_equal'] else 'NO'} |",
             "", "| fault class | count | recover median (s) | max (s) | steps lost max | "
             "training time lost (s) | detected as | recovered |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in sorted(r["mttr_by_class"].items(), key=lambda kv: -kv[1]["cost_s_total"]):
        lines.append(f"| {name} | {r['faults_by_class'][name]} | {c['median']:.1f} | {c['max']:.1f} | "
                     f"{c['lost_steps_max']} | {c['cost_s_total']:.0f} | {', '.join(c['detected_as'])} | "
                     f"{', '.join(c.get('where', ['requeue']))} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--fault-every", type=float, default=180.0, help="mean seconds between faults")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--spares", type=int, default=0,
                   help="hot spare nodes (in-allocation mode, issue 27); 0: the requeue path only")
    p.add_argument("--refill", action="store_true",
                   help="with --spares: SLURMFT_SPARE_REFILL=1, spare jobs from outside the allocation")
    p.add_argument("--dir", type=Path, help="work dir (default: a new temp dir)")
    p.add_argument("--cpu-cap", type=float, metavar="CPUS",
                   help="run the devcluster and its job in a cgroup allowed CPUS CPUs (root)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("soak: must run as root (it starts Slurm daemons)", file=sys.stderr)
        return 1
    if args.minutes <= 0 or args.fault_every <= 0:
        print("soak: --minutes and --fault-every must be > 0", file=sys.stderr)
        return 1
    if not 0 <= args.spares <= 2:
        print(f"soak: --spares {args.spares}: must be 0, 1 or 2", file=sys.stderr)
        return 1
    if args.refill and not args.spares:
        print("soak: --refill needs --spares 1 or 2", file=sys.stderr)
        return 1
    if args.cpu_cap is not None:
        try:
            check(args.cpu_cap)
        except CapError as exc:
            print(f"soak: {exc}", file=sys.stderr)
            return 1
    work = (args.dir or Path(tempfile.mkdtemp(prefix="slurmft-soak."))).absolute()
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"soak: --dir {work}: {exc.strerror}", file=sys.stderr)
        return 1
    soak = Soak(work, args.minutes, args.fault_every, args.seed, args.spares, args.cpu_cap, args.refill)

    def terminated(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, terminated)
    try:
        try:
            result = soak.run()
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # nothing cuts the teardown short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            soak.close()
    except (ChaosError, FaultError, ReferenceRunError, DevClusterError, SlurmError, CapError) as exc:
        print(f"soak: {exc} (files: {work})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"soak: interrupted; the cluster is down (files: {work})", file=sys.stderr)
        return 130
    print(json.dumps(result, sort_keys=True) if args.json else render(result))
    return 0 if result["final_state_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
