"""Pure parsers: captured squeue/scontrol/sacct output -> :class:`Job` values.

Controller side (``squeue --json``, ``scontrol --json show job``: the same ``jobs[]`` records) and
accounting side (``sacct --json``; on 22.05 ``sacct -P`` text, whose exit codes are right where
22.05's JSON says SUCCESS/0) are parsed here, for every data_parser from v0.0.38 (22.05) to
v0.0.44 (25.11). No subprocess, no clock: the same text always gives the same jobs.

Normalisation rules (the same for every release):
  * ``exit_code``/``exit_signal`` are None until the job has finished; a raw wait status (22.05
    squeue: exit 3 -> 768) is decoded.
  * ``start_time`` is None while PENDING (Slurm fills in an estimate); ``end_time`` is None until
    the job has finished (Slurm fills in start + time limit).
  * ``min_nodes`` is the requested (or allocated) node count, ``max_nodes`` the upper end of the
    requested range, or ``min_nodes`` when no range was asked for.
  * ``run_dir`` comes from the job's comment: ``--comment=SLURMFT_RUN_DIR=<path>`` (the token may
    share the comment with other text, separated by spaces or commas). The comment is the only
    job field that squeue and sacct both return on every release; the job's environment is not.
  * sacct records lacking ``restart_cnt`` (data_parser < v0.0.42, 22.05 text) get the run's index
    among the records of the same job id, oldest first, which is what Slurm's counter would say.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import hostlist

from slurmft.slurm.client import Job, JobState
from slurmft.slurm.jobstate import job_state
from slurmft.slurm.jsonshape import (
    Where, load_document, number, number_value, records, state_names, text, timestamp,
    timestamp_value,
)

RUN_DIR_TOKEN = "SLURMFT_RUN_DIR="
_RUN_DIR_RE = re.compile(re.escape(RUN_DIR_TOKEN) + r"([^\s,]+)")
_NO_NODES = {"", "None assigned", "(null)"}
_NO_REASON = {"", "None", "(null)"}

# The sacct -P fields the 22.05 text parser reads, in this order (Comment last: it may hold '|').
SACCT_TEXT_FIELDS = (
    "JobIDRaw", "JobName", "State", "Reason", "ExitCode", "Submit", "Eligible", "Start", "End",
    "NodeList", "NNodes", "Partition", "User", "WorkDir", "Comment",
)


def run_dir_from_comment(comment: str) -> Path | None:
    match = _RUN_DIR_RE.search(comment or "")
    return Path(match.group(1)) if match else None


def expand_nodes(expr: str, where: Where) -> tuple[str, ...]:
    """A hostlist expression (``n[1-3],gpu07``) as a tuple of node names."""
    if expr is None or expr.strip() in _NO_NODES:
        return ()
    try:
        return tuple(hostlist.expand_hostlist(expr))
    except hostlist.BadHostlist as exc:
        raise where.unknown(f"hostlist ({exc})", expr) from None


def decode_wait_status(status: int) -> tuple[int | None, int | None]:
    """(exit code, signal) from a raw wait status: 768 -> (3, None), 9 -> (None, 9)."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.WEXITSTATUS(status), None


def exit_status(value: Any, where: Where) -> tuple[int | None, int | None]:
    """(exit code, signal) from any exit_code spelling (raw status, or the 23.11+ object)."""
    if value is None:
        return None, None
    if isinstance(value, dict) and "return_code" in value:
        status = value.get("status")
        statuses = state_names(status, where.key("status")) if status is not None else []
        if "PENDING" in statuses or "INVALID" in statuses:
            return None, None
        code = number_value(value.get("return_code"), where.key("return_code"))
        signal = value.get("signal")
        sig = None
        if isinstance(signal, dict):
            raw = signal.get("id", signal.get("signal_id"))
            sig = number_value(raw, where.key("signal").key("id")) if raw is not None else None
        elif signal is not None:
            raise where.key("signal").fail("object", signal)
        if "SIGNALED" in statuses or (sig and code in (None, 0)):
            return None, sig
        return code, (sig or None)
    raw = number_value(value, where)
    return decode_wait_status(raw) if raw is not None else (None, None)


def _reason(value: str) -> str:
    return "" if value in _NO_REASON else value


def _job_id(rec: Mapping[str, Any], where: Where) -> str:
    job_id = number(rec, "job_id", where)
    if job_id is None:
        raise where.key("job_id").fail("int", rec.get("job_id"))
    array = rec.get("array")  # sacct: {"job_id", "task_id": {...}}
    if isinstance(array, dict):
        parent, task = array.get("job_id"), number_value(array.get("task_id"), where.key("array").key("task_id"))
    else:
        parent = number(rec, "array_job_id", where)
        task = number(rec, "array_task_id", where)
        text = rec.get("array_task_string")
        # A pending array of ONE task is its own record with no task id yet, only the string
        # ("5"): it is that task (sbatch --array=5, as a forgotten task is resubmitted).
        if task is None and isinstance(text, str) and text.isascii() and text.isdigit() and len(text) < 10:
            task = int(text)
    if task is not None and parent:
        return f"{parent}_{task}"
    return str(job_id)


def finished_fields(state: JobState, start: datetime | None, end: datetime | None, exit_value: Any,
                    where: Where) -> tuple[datetime | None, datetime | None, int | None, int | None]:
    """(start, end, exit code, signal) after the normalisation rules in this module's docstring."""
    if not state.finished:
        return (None if state is JobState.PENDING else start), None, None, None
    code, sig = exit_status(exit_value, where)
    return start, end, code, sig


def job_from_squeue(rec: Mapping[str, Any], where: Where) -> Job:
    """One ``jobs[]`` record of ``squeue --json`` / ``scontrol --json show job``."""
    state, flags = job_state(state_names(rec.get("job_state"), where.key("job_state")), where.key("job_state"))
    start, end, code, sig = finished_fields(
        state, timestamp(rec, "start_time", where), timestamp(rec, "end_time", where),
        rec.get("exit_code"), where.key("exit_code"),
    )
    count = number(rec, "node_count", where) or 0
    max_nodes = number(rec, "max_nodes", where) or 0
    nodes = expand_nodes(text(rec, "nodes", where), where.key("nodes"))
    comment = text(rec, "comment", where)
    workdir = text(rec, "current_working_directory", where)
    requeue = rec.get("requeue", True)
    limit_end = None
    if state is JobState.RUNNING and number(rec, "time_limit", where):
        # For a running job Slurm's end_time is start + limit (start + 1 year when unlimited).
        limit_end = timestamp(rec, "end_time", where)
    return Job(
        job_id=_job_id(rec, where),
        raw_job_id=str(number(rec, "job_id", where)),
        name=text(rec, "name", where),
        state=state,
        flags=flags,
        reason=_reason(text(rec, "state_reason", where)),
        nodes=nodes,
        node_count=len(nodes) if nodes else count,
        min_nodes=count,
        max_nodes=max(max_nodes, count),
        excluded_nodes=expand_nodes(text(rec, "excluded_nodes", where), where.key("excluded_nodes")),
        restart_count=number(rec, "restart_cnt", where) or 0,
        exit_code=code,
        exit_signal=sig,
        submit_time=timestamp(rec, "submit_time", where),
        eligible_time=timestamp(rec, "eligible_time", where),
        start_time=start,
        end_time=end,
        partition=text(rec, "partition", where),
        user=text(rec, "user_name", where),
        work_dir=Path(workdir) if workdir else None,
        run_dir=run_dir_from_comment(comment),
        requeue_allowed=bool(requeue) if isinstance(requeue, bool) else True,
        time_limit_end=limit_end,
        reason_detail=text(rec, "state_description", where),
        batch_host=text(rec, "batch_host", where) if state is JobState.RUNNING else "",
    )


def job_from_sacct(rec: Mapping[str, Any], where: Where) -> Job:
    """One ``jobs[]`` record of ``sacct --json`` (one run of a job when ``-D`` is given)."""
    st = rec.get("state")
    if not isinstance(st, dict):
        raise where.key("state").fail("object", st)
    state, flags = job_state(state_names(st.get("current"), where.key("state.current")),
                             where.key("state.current"), accounting=True)
    times = rec.get("time")
    if not isinstance(times, dict):
        raise where.key("time").fail("object", times)
    tw = where.key("time")
    start, end, code, sig = finished_fields(
        state, timestamp(times, "start", tw), timestamp(times, "end", tw),
        rec.get("exit_code"), where.key("exit_code"),
    )
    nodes = expand_nodes(text(rec, "nodes", where), where.key("nodes"))
    comment = rec.get("comment")  # 23.02+: {"job", "administrator", "system"}; a string before
    job_comment = (text(comment, "job", where.key("comment")) if isinstance(comment, dict)
                   else text(rec, "comment", where))
    workdir = text(rec, "working_directory", where)
    restarts = number(rec, "restart_cnt", where)
    count = number(rec, "allocation_nodes", where) or len(nodes)
    user = rec.get("user")
    return Job(
        job_id=_job_id(rec, where),
        raw_job_id=str(number(rec, "job_id", where)),
        name=text(rec, "name", where),
        state=state,
        flags=frozenset(f.upper() for f in rec.get("flags") or () if isinstance(f, str)) | flags,
        reason=_reason(text(st, "reason", where.key("state"))),
        nodes=nodes,
        node_count=len(nodes) or count,
        min_nodes=count,
        max_nodes=count,
        restart_count=-1 if restarts is None else restarts,
        exit_code=code,
        exit_signal=sig,
        submit_time=timestamp(times, "submission", tw),
        eligible_time=timestamp(times, "eligible", tw),
        start_time=start,
        end_time=end,
        partition=text(rec, "partition", where),
        user=user if isinstance(user, str) else "",
        work_dir=Path(workdir) if workdir else None,
        run_dir=run_dir_from_comment(job_comment),
    )


def parse_squeue(output: str, command: str = "squeue --json") -> list[Job]:
    """Every job in a ``squeue --json`` or ``scontrol --json show job`` document."""
    doc = load_document(output, command, "jobs")
    return [job_from_squeue(rec, where) for where, rec in records(doc, "jobs", command)]


def parse_sacct(output: str, command: str = "sacct --json") -> list[Job]:
    """Every record of a ``sacct --json`` document, oldest first, restart counts filled in.
    No record is an empty list on every release (22.05 says "Nothing found" as an error)."""
    doc = load_document(output, command, "jobs", empty_ok=True)
    return _fill_restarts([job_from_sacct(rec, where) for where, rec in records(doc, "jobs", command)])


def _epoch(value: str, where: Where) -> datetime | None:
    if value in ("", "Unknown", "None", "N/A"):
        return None
    try:
        return timestamp_value(int(value), where)
    except ValueError:
        raise where.unknown("time (expected Unix seconds; is SLURM_TIME_FORMAT=%s set?)", value) from None


def parse_sacct_text(output: str, command: str = "sacct -P") -> list[Job]:
    """``sacct -P --noheader -o <SACCT_TEXT_FIELDS>`` run with ``SLURM_TIME_FORMAT=%s`` (22.05)."""
    jobs = []
    for lineno, line in enumerate(l for l in output.splitlines() if l.strip()):
        where = Where(command, f"line {lineno + 1}")
        parts = line.split("|", len(SACCT_TEXT_FIELDS) - 1)
        if len(parts) != len(SACCT_TEXT_FIELDS):
            raise where.unknown(f"record ({len(SACCT_TEXT_FIELDS)} fields expected)", line)
        f = dict(zip(SACCT_TEXT_FIELDS, parts))
        state, flags = job_state([f["State"]], where.key("State"), accounting=True)
        code = sig = None
        if state.finished:
            exit_part, _, sig_part = f["ExitCode"].partition(":")
            try:
                code, sig = int(exit_part), int(sig_part or 0)
            except ValueError:
                raise where.key("ExitCode").unknown("exit code", f["ExitCode"]) from None
            code, sig = (None, sig) if sig else (code, None)
        nodes = expand_nodes(f["NodeList"], where.key("NodeList"))
        count = int(f["NNodes"]) if f["NNodes"].isdigit() else len(nodes)
        jobs.append(Job(
            job_id=f["JobIDRaw"], raw_job_id=f["JobIDRaw"], name=f["JobName"], state=state, flags=flags,
            reason=_reason(f["Reason"]), nodes=nodes, node_count=len(nodes) or count,
            min_nodes=count, max_nodes=count, restart_count=-1, exit_code=code, exit_signal=sig,
            submit_time=_epoch(f["Submit"], where.key("Submit")),
            eligible_time=_epoch(f["Eligible"], where.key("Eligible")),
            start_time=None if state is JobState.PENDING else _epoch(f["Start"], where.key("Start")),
            end_time=_epoch(f["End"], where.key("End")) if state.finished else None,
            partition=f["Partition"], user=f["User"],
            work_dir=Path(f["WorkDir"]) if f["WorkDir"] else None,
            run_dir=run_dir_from_comment(f["Comment"]),
        ))
    return _fill_restarts(jobs)


def _fill_restarts(jobs: list[Job]) -> list[Job]:
    """Sort oldest first; give records without a restart counter their index within the job."""
    # 24.11 keeps the submit time across a requeue: order by start, the never-started run last.
    epoch = datetime.min.replace(tzinfo=timezone.utc)
    ordered = sorted(jobs, key=lambda j: (j.submit_time or epoch, j.start_time is None, j.start_time or epoch))
    seen: dict[str, int] = {}
    out = []
    for job in ordered:
        index = seen.get(job.job_id, 0)
        seen[job.job_id] = index + 1
        out.append(replace(job, restart_count=index) if job.restart_count < 0 else job)
    return out
