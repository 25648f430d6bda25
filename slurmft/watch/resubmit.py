"""Bringing back a job Slurm has forgotten (ended while no watcher ran, past MinJobAge).

At first sight of a job the watcher saves, in ``<run_dir>/watch/``, the job's sbatch command line
(accounting's SubmitLine) and its batch script (the controller's copy: accounting may not keep
it). A forgotten job that is not DONE is submitted again from these: the same options and script
arguments, the saved script in place of the original (whose file may have changed since), the
nodes excluded so far merged with the user's own ``--exclude``, and the comment naming the run dir
so a restarted watcher can find the new job instead of submitting twice. A forgotten array task is
submitted alone, as a one-task array of its own index.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import hostlist

from slurmft.rundir import RunDir, atomic_write_bytes, atomic_write_json
from slurmft.slurm import validate
from slurmft.watch.runview import read_regular, read_small_json

SUBMIT_FILE = "submit.json"
SCRIPT_FILE = "batch_script.sh"
MAX_SCRIPT = 4 * 1024 * 1024


class ResubmitError(ValueError):
    """The job cannot be submitted again from what was saved; the message says why."""


@dataclass(frozen=True)
class SubmitRecord:
    job_id: str
    submit_line: str
    work_dir: str
    script_index: int  # the script's position in the split submit line

    @staticmethod
    def paths(run_dir: RunDir) -> tuple[Path, Path]:
        base = run_dir.watch_state.parent
        return base / SUBMIT_FILE, base / SCRIPT_FILE


def split_line(submit_line: str) -> list[str]:
    try:
        tokens = shlex.split(submit_line)
    except ValueError as exc:
        raise ResubmitError(f"cannot parse the recorded submit line: {exc}") from None
    if not tokens or os.path.basename(tokens[0]) != "sbatch":
        raise ResubmitError(f"the recorded submit line is not an sbatch command: {submit_line[:80]!r}")
    return tokens


def find_script(tokens: Sequence[str], work_dir: str, script: bytes) -> int:
    """The script's place in the line: the token naming a file with the script's exact bytes
    (an option's value never is). Done at first sight, while that file is as submitted."""
    for i, token in enumerate(tokens[1:], start=1):
        if token.startswith("-"):
            continue
        candidate = Path(work_dir, token)
        try:
            if (candidate.is_file() and candidate.stat().st_size == len(script)
                    and candidate.read_bytes() == script):
                return i
        except OSError:
            continue
    raise ResubmitError("cannot find the batch script in the recorded submit line")


def save_record(run_dir: RunDir, job_id: str, submit_line: str, work_dir: str, script: str) -> None:
    """Save the job's submission (script first: a record never points at a missing script)."""
    index = find_script(split_line(submit_line), work_dir, script.encode())
    record_path, script_path = SubmitRecord.paths(run_dir)
    atomic_write_bytes(script_path, script.encode(), mode=0o700)
    atomic_write_json(record_path, asdict(SubmitRecord(job_id, submit_line, work_dir, index)))


def load_record(run_dir: RunDir) -> SubmitRecord | None:
    data = read_small_json(SubmitRecord.paths(run_dir)[0])
    if not isinstance(data, dict):
        return None
    try:
        record = SubmitRecord(**data)
    except TypeError:
        return None
    if not (isinstance(record.submit_line, str) and isinstance(record.work_dir, str)
            and isinstance(record.script_index, int) and record.script_index >= 1):
        return None
    return record


def saved_script(run_dir: RunDir) -> bytes | None:
    return read_regular(SubmitRecord.paths(run_dir)[1], MAX_SCRIPT)


EXCLUDE_OPTS, ARRAY_OPTS = ("--exclude", "-x"), ("--array", "-a")


def _take(options: list[str], names: tuple[str, str]) -> tuple[list[str], list[str]]:
    """(options without ``names``' occurrences, their values): ``--long=V``, ``--long V``,
    ``-sV`` and ``-s V``."""
    long, short = names
    kept, values = [], []
    i = 0
    while i < len(options):
        token = options[i]
        if token in (long, short) and i + 1 < len(options):
            values.append(options[i + 1])
            i += 2
            continue
        if token.startswith(long + "="):
            values.append(token[len(long) + 1:])
        elif token.startswith(short) and not token.startswith("--") and len(token) > 2:
            values.append(token[2:])
        else:
            kept.append(token)
        i += 1
    return kept, values


def array_task(job_id: str) -> str | None:
    """The task index of an array task's id (``<array>_<task>``), None for any other job."""
    _, sep, task = job_id.partition("_")
    return task if sep and task.isdigit() else None


def new_job_id(submitted: str, record: SubmitRecord) -> str:
    """The id to follow: sbatch prints the array job's id; the one task in it is ``<id>_<task>``."""
    task = array_task(record.job_id)
    return submitted if task is None or "_" in submitted else f"{submitted}_{task}"


def merged_exclude(user_values: Sequence[str], ours: Sequence[str]) -> list[str]:
    """The user's own ``--exclude`` hostlists and the watcher's nodes, one sorted list."""
    names: set[str] = set(ours)
    for value in user_values:
        if "/" in value:
            raise ResubmitError(f"the recorded --exclude {value!r} names a file: cannot merge the "
                                "watcher's exclusions into it")
        try:
            names.update(hostlist.expand_hostlist(value))
        except hostlist.BadHostlist as exc:
            raise ResubmitError(f"the recorded --exclude {value!r} is not a hostlist: {exc}") from None
    return sorted(names)


def resubmit_argv(record: SubmitRecord, script_path: Path, run_dir: Path,
                  exclude: Sequence[str]) -> list[str]:
    """sbatch arguments for the new submission: the recorded options (minus --parsable), the
    user's own ``--exclude`` merged with the watcher's (one option: sbatch keeps only the last),
    the run dir comment, the saved script, the recorded script arguments. An array task is
    submitted alone (``--array=<its task>``, the recorded ``--array`` dropped): its task id, and
    so its run dir's spelling, stay what they were, and no other task runs twice."""
    tokens = split_line(record.submit_line)
    if record.script_index >= len(tokens):
        raise ResubmitError("the recorded script position is past the end of the submit line")
    options = [t for t in tokens[1:record.script_index] if t != "--parsable"]
    options, user_exclude = _take(options, EXCLUDE_OPTS)
    extra = [f"--comment=SLURMFT_RUN_DIR={run_dir}"]
    task = array_task(record.job_id)
    if task is not None:
        options, _ = _take(options, ARRAY_OPTS)
        extra.append(f"--array={task}")
    nodes = merged_exclude(user_exclude, exclude)
    if nodes:
        extra.append(f"--exclude={validate.compress_nodes(nodes)}")
    return [*options, *extra, str(script_path), *tokens[record.script_index + 1:]]
