"""``CliSlurmClient``: the SlurmClient over squeue/scontrol/sacct/sbatch/scancel.

Four layers per operation: build the argv (values validated first, see ``validate.py``), run it
(``_run``, the one choke point, with timeout and retries in ``runner.py``), parse it (pure
functions in ``parse_jobs.py``/``parse_nodes.py``), decide. Release differences come from
``release.Capabilities`` only.

Where data comes from:
  * ``jobs(ids)``: ONE ``squeue --json`` call. 23.02+: ``-t all -j <ids>`` (finished jobs the
    controller still holds, i.e. within MinJobAge, are included); if Slurm rejects the list
    because one id is unknown, one unfiltered ``squeue -t all`` follows. 22.05: squeue ignores
    ``-j``, so the call is unfiltered and filtered here. Jobs the controller has forgotten are
    absent (nothing is read from accounting here: a poll loop must stay one controller call).
  * ``job(id)``: squeue, then the newest sacct record for ids the controller has forgotten; an id
    neither knows raises JobNotFound with Slurm's message.
  * ``job_history(id)``: ``sacct -D`` (every run); on 22.05 ``sacct -P`` text, whose exit codes
    are right (22.05's sacct JSON reports exit 3 as SUCCESS/0). No record is ``[]`` on every
    release (22.05's JSON says "Nothing found" as an error, 23.02+ as a warning). A run's restart
    count is the record's ``restart_cnt`` where the data_parser reports it (v0.0.42+), else its
    index among the job's runs, which only a ``-D`` listing holds (without ``-D`` sacct shows the
    newest run alone, and v0.0.40/41 give it no count): never read from a listing without ``-D``.
  * ``nodes()``: 23.02+ ``scontrol --json show nodes``; 22.05 ``sinfo --json``.

Every call that changes state runs with ``idempotent=False``: after a timeout it is not sent
again blindly; the job or node is re-read to learn whether it happened (``policy``).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Sequence

from slurmft import steppoint
from slurmft.slurm import parse_steps, policy, validate
from slurmft.slurm.client import (
    InvalidArgument, Job, JobNotFound, JobState, Node, OutcomeUnknown, SlurmError, SlurmInfo,
)
from slurmft.slurm.config import SlurmConfig
from slurmft.slurm.parse_jobs import SACCT_TEXT_FIELDS, parse_sacct, parse_sacct_text, parse_squeue
from slurmft.slurm.parse_nodes import parse_nodes
from slurmft.slurm.release import Capabilities, listed_parsers, parse_version
from slurmft.slurm.runner import Result, Runner

class CliSlurmClient:
    """SlurmClient over Slurm's command line tools. ``env`` overlays the process environment
    for every command (e.g. ``{"SLURM_CONF": ".../slurm.conf"}`` of a devcluster)."""

    def __init__(self, config: SlurmConfig | None = None, *, env: Mapping[str, str] | None = None,
                 runner: Runner | None = None) -> None:
        self.config = config or SlurmConfig()
        self._runner = runner or Runner(self.config, env)
        self._info: SlurmInfo | None = None

    # -- running -------------------------------------------------------------------------------

    def _run(self, argv: Sequence[str], **kwargs) -> Result:
        """Every command this client runs passes here (tests count the calls)."""
        return self._runner.run(argv, **kwargs)

    def _change(self, argv: Sequence[str], happened: Callable[[], bool], **kwargs) -> None:
        """Run a state change; after no answer, ``happened()`` on re-read state decides."""
        policy.change_confirmed(lambda: self._run(argv, idempotent=False, **kwargs), happened)

    def info(self) -> SlurmInfo:
        """Release (from ``sinfo --version``) and the data_parser in use (cached)."""
        if self._info is None:
            out = self._run(["sinfo", "--version"]).stdout
            version = parse_version(out)
            if version is None:
                raise SlurmError(f"sinfo --version: cannot read a Slurm release from {out.strip()!r}")
            self._info = SlurmInfo(version=version, data_parser=self._choose_parser(Capabilities(version)))
        return self._info

    def _choose_parser(self, caps: Capabilities) -> str | None:
        pin = self.config.data_parser
        if not caps.data_parser_pins:
            if pin:
                raise InvalidArgument(
                    f"[slurm] data_parser = {pin!r}, but Slurm {'.'.join(map(str, caps.version))} "
                    "has no data_parser pins (remove the setting)"
                )
            return None
        # scontrol lists its data_parser plugins without asking the controller (squeue asks first).
        listing = self._run(["scontrol", "--json=list"], check=False)
        available = listed_parsers(listing.stdout + listing.stderr)
        if pin:
            if available and pin not in available:
                raise InvalidArgument(
                    f"[slurm] data_parser = {pin!r} is not offered by this Slurm; it offers {', '.join(available)}"
                )
            return pin
        return available[-1] if available else None

    @property
    def _caps(self) -> Capabilities:
        return Capabilities(self.info().version)

    def _json(self) -> str:
        parser = self.info().data_parser
        return f"--json={parser}" if parser else "--json"

    # -- observing -----------------------------------------------------------------------------

    def jobs(self, job_ids: Sequence[str]) -> dict[str, Job]:
        """The jobs among ``job_ids`` that the controller still knows, in one squeue call."""
        ids = validate.job_ids(job_ids)
        if not ids:
            return {}
        flag = self._json()
        if not self._caps.json_filters:
            found = parse_squeue(self._run(["squeue", flag]).stdout)
        else:
            try:
                found = parse_squeue(self._run(["squeue", flag, "-t", "all", "-j", ",".join(ids)]).stdout)
            except JobNotFound:
                found = parse_squeue(self._run(["squeue", flag, "-t", "all"]).stdout)
        wanted = set(ids)
        return {job.job_id: job for job in found if job.job_id in wanted}

    def user_jobs(self, user: str) -> dict[str, Job]:
        """Every job of ``user`` the controller still holds (finished ones within MinJobAge
        included), in one squeue call; 22.05 ignores the filter, so it is applied here too."""
        user = validate.user_name(user)
        flag = self._json()
        argv = ["squeue", flag, "-t", "all", "-u", user] if self._caps.json_filters else ["squeue", flag]
        return {job.job_id: job for job in parse_squeue(self._run(argv).stdout) if job.user == user}

    def job(self, job_id: str) -> Job:
        """One job from the controller, else its newest accounting record; else JobNotFound."""
        job_id = validate.job_id(job_id)
        slurm_says: JobNotFound | None = None
        try:
            found = self.jobs([job_id])
        except JobNotFound as exc:
            found, slurm_says = {}, exc
        if job_id in found:
            return found[job_id]
        history = self.job_history(job_id)
        if history:
            return history[-1]
        if slurm_says is None:  # 22.05: squeue never complains; ask scontrol for Slurm's verdict
            self._run(["scontrol", "show", "job", job_id])
            slurm_says = JobNotFound(f"squeue: job {job_id} not listed")
        raise slurm_says

    def job_history(self, job_id: str) -> list[Job]:
        """Accounting records of every run of the job (``sacct -D``), oldest first."""
        job_id = validate.job_id(job_id)
        if self._caps.sacct_json_exit_codes:
            out = self._run(["sacct", self._json(), "-D", "-j", job_id]).stdout
            records = parse_sacct(out)
        else:
            out = self._run(
                ["sacct", "-P", "--noheader", "-D", "-X", "-j", job_id, "-o", ",".join(SACCT_TEXT_FIELDS)],
                env={"SLURM_TIME_FORMAT": "%s"},
            ).stdout
            records = parse_sacct_text(out)
            if "_" in job_id:  # sacct -j <array>_<task> lists that task alone; the text has its raw id
                records = [dataclasses.replace(job, job_id=job_id) for job in records]
        return [job for job in records if job.job_id == job_id]

    def failed_launch_nodes(self, job: Job) -> tuple[tuple[str, ...], str]:
        """The nodes the job's newest run failed to launch on or failed its prolog on: that
        run from accounting's step records (``parse_steps``), its nodes' drains from the node
        table (``policy.launch_failure_nodes``); ``((), "")`` while accounting has none."""
        raw = validate.job_id(job.raw_job_id or job.job_id)
        out = self._run(["sacct", "-P", "--noheader", "-D", "-j", raw,
                         "-o", ",".join(parse_steps.STEP_FIELDS)]).stdout
        run = parse_steps.failed_run(out, raw)
        if run is None:
            return (), ""
        return policy.launch_failure_nodes(run, self.nodes(run.nodes) if run.nodes else {})

    def release_launch_hold(self, job_id: str) -> None:
        job_id = validate.job_id(job_id)
        policy.release_launch_hold(lambda: self.job(job_id), lambda: self.release(job_id))

    def nodes(self, names: Sequence[str] | None = None) -> dict[str, Node]:
        """Nodes by name; with ``names``, only those (unknown names are absent)."""
        wanted = None if names is None else set(validate.node_names(names))
        if self._caps.scontrol_json:
            command = ["scontrol", self._json(), "show", "nodes"]
        else:
            command = ["sinfo", self._json()]
        found = parse_nodes(self._run(command).stdout, " ".join(command))
        return found if wanted is None else {n: v for n, v in found.items() if n in wanted}

    # -- acting --------------------------------------------------------------------------------

    def submit(self, script: Path, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
               sbatch_options: Sequence[str] = ()) -> str:
        """``sbatch --parsable [options] script [args]`` -> job id. Not retried after a timeout
        (the job may have been submitted)."""
        script = Path(script)
        if not script.is_file():
            raise InvalidArgument(f"batch script {script} does not exist")
        for value in (*sbatch_options, *args):
            if not isinstance(value, str) or "\x00" in value:
                raise InvalidArgument(f"invalid sbatch argument {value!r}")
        for value in sbatch_options:
            if not value.startswith("-"):
                raise InvalidArgument(f"sbatch option {value!r} must start with '-' (use --opt=value)")
        out = self._run(["sbatch", "--parsable", *sbatch_options, str(script), *args],
                        env=env, idempotent=False).stdout
        job_id = out.strip().split(";", 1)[0]
        return validate.job_id(job_id)

    def resubmit(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None) -> str:
        """``sbatch --parsable --chdir=<cwd> <argv>`` -> job id; ``argv`` is a job's own recorded
        sbatch arguments with an absolute script path (its owner's words, run with its owner's
        rights, never a shell). Not retried after a timeout (the job may have been submitted)."""
        for value in argv:
            if not isinstance(value, str) or "\x00" in value:
                raise InvalidArgument(f"invalid sbatch argument {value!r}")
        if not argv or not Path(cwd).is_dir():
            raise InvalidArgument(f"resubmit: nothing to submit, or {cwd} is not a directory")
        out = self._run(["sbatch", "--parsable", f"--chdir={cwd}", *argv], env=env,
                        idempotent=False).stdout
        return validate.job_id(out.strip().split(";", 1)[0])

    def submit_line(self, job_id: str) -> str | None:
        """SubmitLine from accounting (``sacct -X -o SubmitLine``, 21.08+); None when empty."""
        out = self._run(["sacct", "-X", "-P", "--noheader", "-j", validate.job_id(job_id),
                         "-o", "SubmitLine"]).stdout
        lines = [line for line in out.splitlines() if line.strip()]
        return lines[-1] if lines else None

    def batch_script(self, job_id: str) -> str:
        """``scontrol write batch_script JOBID -`` (the controller's copy)."""
        return self._run(["scontrol", "write", "batch_script", validate.job_id(job_id), "-"]).stdout

    def cancel(self, job_id: str, *, signal: str | None = None, batch_only: bool = False) -> None:
        """``scancel`` the job, or send ``signal`` (to the batch step only when ``batch_only``)."""
        argv = ["scancel"]
        if signal is not None:
            argv.append(f"--signal={validate.signal_name(signal)}")
        if batch_only:
            argv.append("--batch")
        job_id = validate.job_id(job_id)
        if signal is not None:  # a signal's delivery cannot be read back: never sent twice
            self._run([*argv, job_id], idempotent=False)
            return
        self._change([*argv, job_id], lambda: policy.gone_or_ending(self.jobs, job_id))

    def signal_step(self, job_id: str, step_id: str, signal: str = "KILL") -> None:
        """``scancel --signal=SIG JOB.STEP``: one step's tasks only (in-allocation mode fences a
        node by killing its step). Sent once: a signal's delivery cannot be read back."""
        target = f"{validate.job_id(job_id)}.{validate.step_id(step_id)}"
        self._run(["scancel", f"--signal={validate.signal_name(signal)}", target], idempotent=False)

    def requeue(self, job_id: str) -> bool:
        """Requeue unless the job completed successfully, decided from its state
        (``policy.requeue_by_state``): PENDING -> True, nothing done; RUNNING/SUSPENDED ->
        ``scontrol requeue Incomplete``; FAILED/NODE_FAIL/TIMEOUT/... -> ``scontrol requeue``;
        COMPLETED -> False. Never a plain requeue on a job that may have completed."""
        job_id = validate.job_id(job_id)

        def run_requeue(incomplete: bool) -> None:
            self._run(["scontrol", "requeue", *(["Incomplete"] if incomplete else []), job_id],
                      idempotent=False)

        return policy.requeue_by_state(lambda: self.job(job_id), run_requeue, wait_s=self.config.timeout,
                                       decided=lambda job: steppoint.reached("slurm.requeue", job_id))

    def update_pending(self, job_id: str, *, exclude_nodes: Sequence[str] = (),
                       readmit_nodes: Sequence[str] = (), start_now: bool = False) -> None:
        """Merge ``exclude_nodes`` into the pending job's ExcNodeList and take ``readmit_nodes``
        out of it (Slurm replaces the list on update, so the current one is read first), and/or
        set ``StartTime=now``."""
        job_id = validate.job_id(job_id)
        extra = validate.node_names(exclude_nodes)
        readmit = validate.node_names(readmit_nodes)
        if not extra and not readmit and not start_now:
            return
        argv = ["scontrol", "update", f"JobId={job_id}"]
        if extra or readmit:
            job = self.job(job_id)
            if not policy.excludable_now(job):
                raise SlurmError(f"job {job_id} is {job.state.value}, not PENDING: ExcNodeList not changed")
            argv.append(f"ExcNodeList={policy.merged_exclusions(job, extra, readmit)}")
        if start_now:
            argv.append("StartTime=now")
        self._change(argv, lambda: policy.pending_update_done(self.job(job_id), extra, start_now,
                                                              readmit))

    def release_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        """Take ``nodes`` out of the running job's allocation (``scontrol update JobId=J
        NodeList=<the others>``, the owner may): Slurm then ends or requeues the job without
        waiting on their slurmd. Raises SlurmError when the job is not RUNNING or would keep no
        node, and does nothing when none of ``nodes`` is in it."""
        job_id = validate.job_id(job_id)
        gone = set(validate.node_names(nodes))
        job = self.job(job_id)
        if job.state is not JobState.RUNNING or job.completing:
            raise SlurmError(f"job {job_id} is {job.state.value}, not RUNNING: no node released")
        keep = [n for n in job.nodes if n not in gone]
        if len(keep) == len(job.nodes):
            return
        if not keep:
            raise SlurmError(f"job {job_id}: releasing {','.join(sorted(gone))} would leave it no node")
        # scontrol writes slurm_job_<id>_resize.{sh,csh} (the shrunk job's variables) into its
        # working directory: in a job, the user's submit directory. Ours is a scratch one.
        with tempfile.TemporaryDirectory(prefix="slurmft-resize-") as scratch:
            self._change(["scontrol", "update", f"JobId={job_id}",
                          f"NodeList={validate.compress_nodes(keep)}"],
                         lambda: not gone & set(self.job(job_id).nodes), cwd=scratch)

    def comment(self, job_id: str) -> str:
        """The job's comment text ('' when none): ``squeue -h -o %k`` (text output honours ``-j``
        on every release, unlike 22.05's JSON)."""
        out = self._run(["squeue", "-h", "-j", validate.job_id(job_id), "-o", "%k"]).stdout.strip()
        return "" if out in ("", "(null)") else out

    def set_comment(self, job_id: str, text: str) -> None:
        """``scontrol update JobId=<id> Comment=<text>`` (one printable line)."""
        if not isinstance(text, str) or not text.isprintable() or len(text) > 1000:
            raise InvalidArgument(f"invalid job comment {text!r}: one printable line, at most 1000 characters")
        self._run(["scontrol", "update", f"JobId={validate.job_id(job_id)}", f"Comment={text}"])

    def requeue_hold(self, job_id: str) -> bool:
        job_id = validate.job_id(job_id)

        def run_requeue_hold(incomplete: bool) -> None:
            self._run(["scontrol", "requeuehold", *(["Incomplete"] if incomplete else []), job_id],
                      idempotent=False)

        done = policy.requeue_by_state(lambda: self.job(job_id), run_requeue_hold,
                                       wait_s=self.config.timeout,
                                       decided=lambda job: steppoint.reached("slurm.requeuehold", job_id))
        if done and self.job(job_id).reason not in policy.HELD_REASONS:
            self.hold(job_id)  # already pending (Slurm requeued it itself): nothing was sent
        return done

    def hold(self, job_id: str) -> None:
        job_id = validate.job_id(job_id)
        self._change(["scontrol", "hold", job_id], lambda: self.job(job_id).reason in policy.HELD_REASONS)

    def release(self, job_id: str) -> None:
        job_id = validate.job_id(job_id)
        self._change(["scontrol", "release", job_id],
                     lambda: self.job(job_id).reason not in policy.HELD_REASONS)

    def drain(self, node: str, reason: str) -> None:
        """Drain ``node``; ``reason`` is cleaned and cut (``validate.reason``)."""
        name, text = validate.node_name(node), validate.reason(reason)
        argv = ["scontrol", "update", f"NodeName={name}", "State=DRAIN", f"Reason={text}"]

        def drained() -> bool:
            now = self.nodes([name]).get(name)
            return now is not None and now.drained and now.reason == text
        self._change(argv, drained)

    def set_down(self, node: str, reason: str) -> None:
        """Mark ``node`` DOWN with ``reason`` (cleaned and cut like a drain reason)."""
        name, text = validate.node_name(node), validate.reason(reason)

        def down() -> bool:
            now = self.nodes([name]).get(name)
            return now is not None and now.down
        self._change(["scontrol", "update", f"NodeName={name}", "State=DOWN", f"Reason={text}"],
                     down)

    def resume(self, node: str) -> None:
        """Return a drained/down node to service; a node already in service is left as is
        (Slurm says "Invalid node state specified" for it)."""
        name = validate.node_name(node)

        def in_service() -> bool:
            now = self.nodes([name]).get(name)
            return now is not None and not now.drained and not now.down
        try:
            self._change(["scontrol", "update", f"NodeName={name}", "State=RESUME"], in_service)
        except OutcomeUnknown:
            raise
        except SlurmError as exc:
            current = self.nodes([name]).get(name)
            if "Invalid node state" not in str(exc) or current is None or current.drained or current.down:
                raise
