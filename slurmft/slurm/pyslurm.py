"""``PyslurmClient``: the SlurmClient over pyslurm's 25.x API (``pyslurm.Jobs.load``,
``Job.modify``, ``Node.modify``...), used only when pyslurm imports and was built for the running
Slurm's major.minor (see ``backend.py``); otherwise the CLI backend is used, silently.

UNTESTED AGAINST A LIVE CLUSTER: pyslurm on PyPI builds only against Slurm 25.11 and no Debian
release ships 25.11, so this module is written from pyslurm's documented API and exercised with
a stand-in module in the unit tests. What it delegates to the CLI backend, and why:
  * ``submit`` (sbatch semantics: script + args + environment) and ``job_history`` (sacct);
  * ``requeue``: pyslurm offers no "Incomplete" requeue flag, and a plain requeue that races a
    job's successful completion would requeue a COMPLETED job -- the CLI path cannot.
Each call runs in its own daemon thread, bounded by the configured timeout, with the CLI's retry
policy for reads. A libslurm call that never returns is abandoned, not waited on, so it cannot
block the calls after it; past ``MAX_HUNG`` such calls the client refuses new ones (the process
should be restarted). A call that changes state (drain, resume, hold, release, modify, cancel,
signal) is never retried blindly after a timeout: the state is re-read (``policy``), as in the
CLI backend.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence, TypeVar

from slurmft.slurm import policy, validate
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import (
    InvalidArgument, Job, JobNotFound, JobState, Node, OutcomeUnknown, SlurmError, SlurmInfo,
    SlurmUnavailable,
)
from slurmft.slurm.config import SlurmConfig
from slurmft.slurm.jobstate import job_state, node_state
from slurmft.slurm.jsonshape import Where, timestamp_value
from slurmft.slurm.parse_jobs import expand_nodes, finished_fields, run_dir_from_comment
from slurmft.slurm.runner import classify_message, is_transient, may_have_happened, retrying

T = TypeVar("T")
_NO_REASON = {"", "None", "(null)"}
# libslurm calls that never returned (their threads are abandoned) before new calls are refused.
MAX_HUNG = 4


class _Transient(Exception):
    pass


def job_from_pyslurm(obj: Any) -> Job:
    """A ``pyslurm.Job`` (attributes as documented for pyslurm 25.x) -> Job."""
    where = Where("pyslurm Job", f"job {getattr(obj, 'id', '?')}")
    state, flags = job_state([str(obj.state or "")], where.key("state"))
    start, end, _, _ = finished_fields(
        state, timestamp_value(obj.start_time, where.key("start_time")),
        timestamp_value(obj.end_time, where.key("end_time")), None, where.key("exit_code"),
    )
    code = sig = None
    if state.finished:  # pyslurm has already decoded the wait status
        sig = obj.exit_code_signal or None
        code = None if sig else obj.exit_code
    nodes = expand_nodes(obj.allocated_nodes or "", where.key("allocated_nodes"))
    count = obj.num_nodes or 0
    reason = obj.state_reason or ""
    return Job(
        job_id=str(obj.id), raw_job_id=str(obj.id), name=obj.name or "", state=state, flags=flags,
        reason="" if reason in _NO_REASON else reason,
        nodes=nodes, node_count=len(nodes) or count, min_nodes=count,
        max_nodes=max(obj.max_nodes or 0, count),
        excluded_nodes=expand_nodes(obj.excluded_nodes or "", where.key("excluded_nodes")),
        restart_count=obj.requeue_count or 0, exit_code=code, exit_signal=sig,
        submit_time=timestamp_value(obj.submit_time, where.key("submit_time")),
        eligible_time=timestamp_value(obj.eligible_time, where.key("eligible_time")),
        start_time=start, end_time=end, partition=obj.partition or "", user=obj.user_name or "",
        work_dir=Path(obj.working_directory) if obj.working_directory else None,
        run_dir=run_dir_from_comment(obj.comment or ""),
        requeue_allowed=bool(obj.is_requeueable),
        reason_detail=str(getattr(obj, "state_description", "") or ""),
        time_limit_end=(timestamp_value(obj.end_time, where.key("end_time"))
                        if state is JobState.RUNNING and getattr(obj, "time_limit", None) else None),
    )


def node_from_pyslurm(obj: Any) -> Node:
    """A ``pyslurm.Node`` (``state`` like ``IDLE+DRAIN``) -> Node."""
    where = Where("pyslurm Node", f"node {obj.name}")
    base, flags = node_state([s for s in str(obj.state or "").split("+") if s], [], where.key("state"))
    parts = getattr(obj, "partitions", None) or []
    return Node(name=obj.name, state=base, flags=flags, reason=obj.reason or "",
                reason_user=obj.reason_user or "",
                partitions=frozenset(p for p in parts if isinstance(p, str) and p))


def _numeric(job_id: str) -> int:
    if not job_id.isdigit():
        raise InvalidArgument(f"job id {job_id!r}: the pyslurm backend takes plain job ids, not array tasks "
                              "(set [slurm] backend = 'cli')")
    return int(job_id)


class PyslurmClient:
    """SlurmClient over an imported pyslurm module; ``cli`` serves what pyslurm does not."""

    def __init__(self, module: ModuleType, config: SlurmConfig, *, cli: CliSlurmClient,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._ps = module
        self.config = config
        self._cli = cli
        self._sleep = sleep
        self._hung: list[threading.Thread] = []

    def _bounded(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` in a daemon thread of its own; TimeoutError after ``config.timeout``."""
        self._hung = [t for t in self._hung if t.is_alive()]
        if len(self._hung) >= MAX_HUNG:
            raise SlurmUnavailable(f"could not observe: pyslurm {what}: {len(self._hung)} earlier "
                                   "libslurm calls never returned; not starting another "
                                   "(restart this process, or set [slurm] backend = 'cli')")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"pyslurm-{what}", daemon=True)
        thread.start()
        thread.join(self.config.timeout)
        if thread.is_alive():
            self._hung.append(thread)
            raise TimeoutError(f"no answer within {self.config.timeout:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _call(self, what: str, fn: Callable[[], T], *, idempotent: bool = True) -> T:
        """Run one pyslurm call with timeout and (for reads) retries; map RPCError to the typed
        errors. ``idempotent=False``: no answer raises OutcomeUnknown, never a second send."""
        def attempt() -> T:
            try:
                return self._bounded(what, fn)
            except TimeoutError as exc:
                if not idempotent:
                    raise OutcomeUnknown(f"pyslurm {what}: {exc}; not retried (it may have taken "
                                         "effect)") from None
                raise _Transient(str(exc)) from None
            except self._ps.RPCError as exc:
                text = str(exc)
                if is_transient(text, idempotent=idempotent):
                    raise _Transient(text) from None
                if not idempotent and may_have_happened(text):
                    raise OutcomeUnknown(f"pyslurm {what}: {text}; not retried (it may have taken "
                                         "effect)") from None
                raise classify_message(text, text, where=f"pyslurm {what}") from None
        try:
            return retrying(self.config, self._sleep, _Transient)(attempt)
        except _Transient as exc:
            raise SlurmUnavailable(f"could not observe: pyslurm {what}: {exc}") from None

    def _change(self, what: str, fn: Callable[[], Any], happened: Callable[[], bool]) -> None:
        policy.change_confirmed(lambda: self._call(what, fn, idempotent=False), happened)

    def info(self) -> SlurmInfo:
        base = self._cli.info()
        return SlurmInfo(version=base.version, data_parser=None,
                         extra={"backend": "pyslurm", "pyslurm": str(self._ps.__version__)})

    def jobs(self, job_ids: Sequence[str]) -> dict[str, Job]:
        """One ``Jobs.load()`` (one controller RPC); jobs the controller forgot are absent."""
        wanted = set(validate.job_ids(job_ids))
        if not wanted:
            return {}
        loaded = self._call("Jobs.load", self._ps.Jobs.load)
        return {j.job_id: j for j in map(job_from_pyslurm, loaded.values()) if j.job_id in wanted}

    def job(self, job_id: str) -> Job:
        job_id = validate.job_id(job_id)
        try:
            return job_from_pyslurm(self._call("Job.load", lambda: self._ps.Job.load(_numeric(job_id))))
        except JobNotFound:
            history = self._cli.job_history(job_id)
            if history:
                return history[-1]
            raise

    def job_history(self, job_id: str) -> list[Job]:
        return self._cli.job_history(job_id)

    def failed_launch_nodes(self, job: Job) -> tuple[tuple[str, ...], str]:
        return self._cli.failed_launch_nodes(job)

    def release_launch_hold(self, job_id: str) -> None:
        self._cli.release_launch_hold(job_id)

    def nodes(self, names: Sequence[str] | None = None) -> dict[str, Node]:
        wanted = None if names is None else set(validate.node_names(names))
        loaded = self._call("Nodes.load", self._ps.Nodes.load)
        found = {n.name: n for n in map(node_from_pyslurm, loaded.values())}
        return found if wanted is None else {k: v for k, v in found.items() if k in wanted}

    def submit(self, script: Path, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
               sbatch_options: Sequence[str] = ()) -> str:
        return self._cli.submit(script, args, env=env, sbatch_options=sbatch_options)

    def cancel(self, job_id: str, *, signal: str | None = None, batch_only: bool = False) -> None:
        job_id = validate.job_id(job_id)
        job = self._ps.Job(_numeric(job_id))
        if signal is None and not batch_only:
            self._change("Job.cancel", job.cancel, lambda: policy.gone_or_ending(self.jobs, job_id))
            return
        sig = "SIG" + validate.signal_name(signal if signal is not None else "KILL")
        steps = "batch" if batch_only else "children"
        # a signal's delivery cannot be read back: never sent twice
        self._call("Job.send_signal", lambda: job.send_signal(sig, steps=steps), idempotent=False)

    def requeue(self, job_id: str) -> bool:
        return self._cli.requeue(job_id)

    def update_pending(self, job_id: str, *, exclude_nodes: Sequence[str] = (),
                       readmit_nodes: Sequence[str] = (), start_now: bool = False) -> None:
        job_id = validate.job_id(job_id)
        extra = validate.node_names(exclude_nodes)
        readmit = validate.node_names(readmit_nodes)
        if not extra and not readmit and not start_now:
            return
        changes: dict[str, str] = {}
        if extra or readmit:
            job = self.job(job_id)
            if not policy.excludable_now(job):
                raise SlurmError(f"job {job_id} is {job.state.value}, not PENDING: ExcNodeList not changed")
            changes["excluded_nodes"] = policy.merged_exclusions(job, extra, readmit)
        if start_now:
            changes["begin_time"] = "now"
        desc = self._ps.JobSubmitDescription(**changes)
        self._change("Job.modify", lambda: self._ps.Job(_numeric(job_id)).modify(desc),
                     lambda: policy.pending_update_done(self.job(job_id), extra, start_now,
                                                              readmit))

    def requeue_hold(self, job_id: str) -> bool:
        return self._cli.requeue_hold(job_id)

    def hold(self, job_id: str) -> None:
        job_id = validate.job_id(job_id)
        job = self._ps.Job(_numeric(job_id))
        self._change("Job.hold", job.hold, lambda: self.job(job_id).reason in policy.HELD_REASONS)

    def release(self, job_id: str) -> None:
        job_id = validate.job_id(job_id)
        job = self._ps.Job(_numeric(job_id))
        self._change("Job.release", job.release, lambda: self.job(job_id).reason not in policy.HELD_REASONS)

    def drain(self, node: str, reason: str) -> None:
        name, text = validate.node_name(node), validate.reason(reason)

        def drained() -> bool:
            now = self.nodes([name]).get(name)
            return now is not None and now.drained and now.reason == text
        self._change("Node.modify", lambda: self._ps.Node(name).modify(
            self._ps.Node(state="DRAIN", reason=text)), drained)

    def resubmit(self, argv, *, cwd, env=None) -> str:
        return self._cli.resubmit(argv, cwd=cwd, env=env)

    def submit_line(self, job_id: str):
        return self._cli.submit_line(job_id)

    def batch_script(self, job_id: str) -> str:
        return self._cli.batch_script(job_id)

    def user_jobs(self, user: str) -> dict:
        return self._cli.user_jobs(user)

    def release_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self._cli.release_nodes(job_id, nodes)  # rare (a requeue from the allocation): the CLI suffices

    def set_down(self, node: str, reason: str) -> None:
        self._cli.set_down(node, reason)  # rare and operator-only: the CLI's checks suffice

    def resume(self, node: str) -> None:
        name = validate.node_name(node)

        def in_service() -> bool:
            now = self.nodes([name]).get(name)
            return now is not None and not now.drained and not now.down
        self._change("Node.modify", lambda: self._ps.Node(name).modify(self._ps.Node(state="RESUME")),
                     in_service)
