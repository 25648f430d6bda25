"""The launcher's order of work, and the one place that decides its exit code.

  identity + settings (bad input -> 86, the one deliberate "do not requeue" besides training's)
  -> the run dir's claim (another live job's: 86) -> job comment
  -> pre-flight (exclusions -> requeue, 85) -> a signal before training? (checked)
  -> rendezvous -> training step with signals forwarded -> outcome -> 0 / 85 / 86 / passed on.

A missing tool, a failed pre-flight or a stray signal never ends in 86: they are requeued (by
Slurm, or by ``slurmft watch`` from a journaled ``requeue_request``) or passed on (exit 1: a run
dir whose filesystem this node cannot reach).
"""

from __future__ import annotations

import os
import shutil
import sys
from functools import partial
from typing import Mapping, Sequence

from slurmft import exitcodes, journal
from slurmft.journal import read_events, segment_outcome
from slurmft.launch import identity as identity_mod
from slurmft.launch import alloc_settings, claim, handback, inalloc, preflight, rendezvous, requeue
from slurmft.launch import settings as settings_mod
from slurmft.launch.journaling import Voice
from slurmft.launch.outcome import Next, decide
from slurmft.launch.signals import SignalLog, is_for_this_run
from slurmft.launch.step import run_step
from slurmft.rundir import RunDir
from slurmft.slurm.client import JobNotFound, SlurmError

USAGE = ("usage: slurmft launch SCRIPT.py [ARGS...]  (or -m MODULE [ARGS...])\n"
         "Run a training script across this Slurm allocation (what sbatch_templates/train.sbatch\n"
         "execs); settings come from the SLURMFT_* environment (see the template). Exit: 0\n"
         "finished, 85 requeue me, 86 do not requeue, anything else left to slurmft watch.")


def give_up(voice: Voice, reason: str) -> int:
    voice.log(f"ERROR: {reason} -> exit {exitcodes.NO_REQUEUE} (do not requeue)")
    voice.template("give_up", reason=reason)
    return exitcodes.NO_REQUEUE


def check_command(command: Sequence[str], cwd: str) -> str | None:
    if not command:
        return f"no training command: {USAGE}"
    if command[0] == "-m":
        return None if len(command) >= 2 else "-m needs a module name"
    if not os.access(command[0], os.R_OK) or not os.path.isfile(command[0]):
        return f"training script {command[0]} does not exist or is not readable (cwd: {cwd})"
    return None


def check_run_dir_here(run_dir: str) -> tuple[str, bool] | None:
    """The run dir as the batch node sees it: a directory (created if missing), not a file.
    A problem is (reason, node_trouble). A run dir this node cannot create is node trouble
    whatever the errno: an unmounted shared filesystem leaves a root-owned mount point (EACCES),
    a hung one EIO/ESTALE; passed on, the watcher's crash-loop limit bounds a wrong path."""
    if os.path.lexists(run_dir) and (os.path.islink(run_dir) or not os.path.isdir(run_dir)):
        return f"SLURMFT_RUN_DIR={run_dir}: it is not a directory", False
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as exc:
        return f"SLURMFT_RUN_DIR={run_dir}: cannot create it: {exc.strerror or exc}", True
    return None


def launch(command: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    signals = SignalLog()
    signals.install()  # from here on a TERM/USR2 is recorded, never fatal
    voice = Voice(None)
    try:
        ident = identity_mod.from_environ(env)
    except identity_mod.IdentityError as exc:
        return give_up(voice, str(exc))
    voice = Voice(ident)
    try:
        run_dir = settings_mod.run_dir_for(env.get("SLURMFT_RUN_DIR"), ident)
    except settings_mod.SettingsError as exc:
        return give_up(voice, str(exc))
    here = check_run_dir_here(str(run_dir))
    if here is not None:
        reason, node_trouble = here
        if not node_trouble:
            return give_up(voice, reason)
        # Not 86: on another node the filesystem may be there; the watcher decides (bounded).
        voice.log(f"ERROR: {reason} (this node cannot reach it) -> exit 1, passed on to slurmft watch")
        return 1
    client = requeue.slurm_client(env)
    try:
        claim.claim_run_dir(run_dir, ident, None if client is None else partial(job_alive, client))
    except claim.ClaimRefused as exc:  # not journaled: the run dir is another job's
        if exc.code == exitcodes.NO_REQUEUE:
            return give_up(voice, str(exc))
        voice.log(f"ERROR: {exc} -> exit 1, passed on to slurmft watch")
        return 1
    voice = Voice(ident, run_dir)  # from here on, reasons are journaled too
    try:
        cfg = settings_mod.from_environ(env, ident)
        alloc = alloc_settings.from_environ(env, ident)
    except settings_mod.SettingsError as exc:
        return give_up(voice, str(exc))
    problem = check_command(command, os.getcwd())
    if problem:
        return give_up(voice, problem)
    if shutil.which("srun", path=env.get("PATH", "")) is None:
        # Not 86: the same job may run where srun is on the PATH; the watcher decides.
        voice.log("ERROR: srun is not on the PATH: cannot start the pre-flight or the training step")
        voice.template("error", reason="srun is not on the PATH")
        return 1

    env["SLURMFT_RUN_DIR"] = str(cfg.run_dir)
    env["SLURMFT_JOB_ID"] = ident.slurm_id  # the array-aware id, for the ranks
    env["SLURMFT_PG_TIMEOUT_S"] = str(cfg.pg_timeout_s)
    if alloc is not None:  # the ranks wait on a re-forming by it: the value judged here, one place
        env["SLURMFT_NODE_SILENT_S"] = f"{alloc.node_silent_s:g}"
    voice.template("launch", nodes=list(ident.nodes), scontrol=client is not None,
                   nproc_per_node=cfg.nproc_per_node)
    requeue.publish_run_dir(client, ident, str(cfg.run_dir), voice)

    voice.log(f"pre-flight on {ident.num_nodes} node(s): {','.join(ident.nodes)} "
              f"(bound {cfg.preflight_timeout_s:g} s)")
    result = preflight.run(ident, cfg, env)
    for node in sorted(result.notes):
        for detail in result.notes[node]:
            voice.log(f"  pre-flight {node}: {detail}")
        voice.template("preflight_note", node=node, evidence=result.notes[node])
    for node in sorted(result.skipped):
        for detail in result.skipped[node]:
            voice.log(f"  pre-flight {node}: not judged: {detail}")
        voice.template("preflight_skip", node=node, evidence=result.skipped[node])
    if not result.ran:
        reason = (f"the pre-flight produced no verdict on any node (srun exit {result.rc}"
                  f"{', timed out' if result.timed_out else ''}): {result.output_tail[-300:].strip()}")
        voice.template("preflight_not_run", reason=reason)
        return requeue.requeue_self(client, ident, voice, reason)
    exclude = result.exclusions()
    own = preflight.jobs_own_failure(result, ident.nodes,
                                     preflight.earlier_failures(cfg.run_dir, ident)) if exclude else None
    if own is not None:  # every node would fail the same: excluding them would walk the cluster
        for node, evidence in exclude.items():
            voice.log(f"  pre-flight {node}: FAILED: {evidence}")
        return give_up(voice, own)
    if exclude:
        for node, evidence in exclude.items():
            voice.log(f"  pre-flight {node}: FAILED: {evidence}")
            voice.template("exclude", node=node, evidence=evidence)
        if ident.num_nodes > 1 and len(exclude) == ident.num_nodes:
            # Every node failing is rarely every node's fault (a shared filesystem): excluding
            # them all would leave the job nothing to run on.
            reason = "the pre-flight failed on every node: requeued without exclusions"
            return requeue.requeue_self(client, ident, voice, reason)
        return requeue.requeue_self(client, ident, voice, "pre-flight failed before rendezvous",
                                    exclude)
    voice.log("pre-flight passed on every node")

    early = signals.take()
    if early:
        job = None
        if client is not None:
            try:
                job = client.job(ident.slurm_id)
            except SlurmError as exc:  # could not observe: take the signal as meant for us
                voice.log(f"WARNING: could not read the job to judge {early}: {exc}")
        act, why = is_for_this_run(job, ident)
        voice.template("early_signal", signals=early, acted=act, why=why)
        if act:
            voice.log(f"received {','.join(early)} before training started ({why}): requeueing; "
                      "the newest checkpoint is intact")
            return requeue.requeue_self(client, ident, voice, f"{early[0]} before training started")
        voice.log(f"ignoring {','.join(early)} received before training started: {why}")

    try:
        rdzv = rendezvous.choose(ident, result.ports, alloc.active[0] if alloc else None)
    except rendezvous.RendezvousError as exc:
        return requeue.requeue_self(client, ident, voice, str(exc))
    voice.log(f"torchrun: {ident.num_nodes} node(s) x {cfg.nproc_per_node} rank(s), "
              f"rendezvous {rdzv.endpoint} id {rdzv.rdzv_id}")

    def forward(name: str) -> None:
        voice.log(f"received {name}: forwarding USR2 to the training step (re-sent every "
                  f"{cfg.resignal_s:g} s until it ends)")
        voice.template("forward", signal=name)

    if alloc is None:
        srun_rc = run_step(rendezvous.step_argv(rdzv, ident, cfg, command), rendezvous.step_env(env, ident),
                           signals, cfg.resignal_s, forward, pending=signals.take())
    else:
        voice.log(f"in-allocation mode: active {','.join(alloc.active)}, spares "
                  f"{','.join(alloc.spares) or 'none'}, at least {alloc.min_nodes} node(s), a node "
                  f"silent {alloc.node_silent_s:g} s is fenced")
        supervisor = inalloc.Supervisor(ident, cfg, alloc, rdzv, command, env, signals, voice,
                                        client, forward, lambda: segment_code(cfg.run_dir, ident))
        try:
            srun_rc = supervisor.run(pending=signals.take())
        except inalloc.GoRequeue as exc:
            supervisor.stop_all()
            handback.release_lost(client, ident.slurm_id, supervisor.lost(list(exc.exclude)),
                                  supervisor.kills.reached, voice.log,
                                  wait_s=handback.wait_bound(client, ident.slurm_id) if client else 0.0,
                                  stop=lambda: bool(signals.received))
            return requeue.requeue_self(client, ident, voice, exc.reason,
                                        supervisor.exclusions(exc.exclude))
        except inalloc.GiveUp as exc:
            supervisor.stop_all()
            return give_up(voice, str(exc))
    recorded = segment_code(cfg.run_dir, ident)
    decision = decide(recorded, srun_rc)
    voice.log(f"training step ended: srun exit {srun_rc}, recorded outcome "
              f"{'none' if recorded is None else exitcodes.describe(recorded)}: {decision.why}")
    if decision.next is Next.REQUEUE:
        return requeue.requeue_self(client, ident, voice, "training saved and asked to be requeued")
    voice.template("end", exit_code=decision.code, why=decision.why)
    return decision.code


def job_alive(client, job_id: str) -> bool | None:
    """Does Slurm still run or queue ``job_id`` (a claim's holder)? None: could not tell."""
    try:
        return not client.job(job_id).state.finished
    except JobNotFound:
        return False
    except SlurmError:
        return None


def segment_code(run_dir, ident) -> int | None:
    """The exit code this segment's ranks journaled (they stamp the raw SLURM_JOB_ID)."""
    events = read_events(RunDir(run_dir).events, [journal.SEGMENT_END])
    for job_id in (ident.raw_job_id, ident.slurm_id):
        event = segment_outcome(events, job_id, ident.restart_count)
        code = None if event is None else event.get("exit_code")
        if isinstance(code, int) and not isinstance(code, bool):
            return code
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if args[:1] == ["--"]:
        args = args[1:]
    return launch(args)
