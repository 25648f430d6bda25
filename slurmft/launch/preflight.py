"""The pre-flight: ``nodecheck`` on every node of the allocation in ONE bounded ``srun``, and the
verdict: which nodes to exclude, with the evidence for each.

Only two things exclude a node: a check that ran there and failed (a ``FAIL`` line), or a node
that did not answer (no ``DONE`` line) within the bound. A check that could not give a verdict
(``SKIP``: a busy sweep, a sweep without a report) is reported, never held against the node. If
NO node answered, the pre-flight itself could not run (srun refused, the step was signalled):
nothing is excluded and the job is requeued as it is.

A failure of the job's own environment (its run dir, that filesystem's free space, its python and
torch: ``JOB_CHECKS``) that every node shares is the job's problem, not its nodes': excluding them
would walk the job across healthy nodes one requeue at a time. It is judged so when the same such
check failed on every node of the allocation, or on this node and, in an earlier try of the same
job (the journal's ``template``/``exclude`` lines), on another node. The launcher then exits "do not
requeue" with one line, excluding nothing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from slurmft import journal
from slurmft.launch.identity import JobIdentity
from slurmft.launch.procs import run_bounded
from slurmft.launch.settings import LaunchSettings
from slurmft.rundir import RunDir

# nodecheck's own deadline is this much shorter than srun's, so a slow node still reports.
NODE_MARGIN_S = 5.0
# Checks of what the job brings (``train.runtime.preflight``): the same on every node it may use.
JOB_CHECKS = frozenset({"run-dir", "disk", "python"})
# The end of the journal read for earlier pre-flight failures (a failed try journals nothing after).
HISTORY_BYTES = 1 << 20


@dataclass
class PreflightResult:
    answered: set[str] = field(default_factory=set)
    failures: dict[str, list[str]] = field(default_factory=dict)    # node -> FAIL details
    skipped: dict[str, list[str]] = field(default_factory=dict)     # node -> SKIP details
    notes: dict[str, list[str]] = field(default_factory=dict)       # node -> NOTE (judged, FYI)
    ports: dict[str, int] = field(default_factory=dict)
    silent: list[str] = field(default_factory=list)                 # did not answer
    timed_out: bool = False
    rc: int | None = None
    output_tail: str = ""

    @property
    def ran(self) -> bool:
        """At least one node answered: the verdict is about nodes, not about the pre-flight."""
        return bool(self.answered)

    def exclusions(self) -> dict[str, str]:
        """node -> evidence, for every node that must be excluded."""
        if not self.ran:
            return {}
        out = {node: "; ".join(details) for node, details in self.failures.items()}
        for node in self.silent:
            out.setdefault(node, "did not answer the pre-flight within its time"
                           if self.timed_out else f"pre-flight task ended without a verdict "
                           f"(srun exit {self.rc})")
        return dict(sorted(out.items()))


def srun_argv(identity: JobIdentity, settings: LaunchSettings, python: str) -> list[str]:
    n = str(identity.num_nodes)
    return ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
            "--job-name=slurmft-preflight", python, "-m", "slurmft.launch.nodecheck",
            str(settings.run_dir), "--min-free-gb", repr(settings.min_free_gb),
            "--deadline-s", repr(max(settings.preflight_timeout_s - NODE_MARGIN_S, 1.0)),
            "--sweep-wait-s", repr(settings.sweep_wait_s),
            "--sweep-fresh-s", repr(settings.sweep_fresh_s)]


def parse(output: str, nodes: Sequence[str], *, rc: int | None) -> PreflightResult:
    """The verdict from nodecheck's lines (anything else srun printed is ignored here)."""
    result = PreflightResult(timed_out=rc is None, rc=rc, output_tail=output[-2000:])
    known = set(nodes)
    for line in output.splitlines():
        parts = line.split(" ", 2)
        if len(parts) < 2 or parts[1] not in known:
            continue
        tag, node = parts[0], parts[1]
        rest = parts[2] if len(parts) > 2 else ""
        if tag == "DONE":
            result.answered.add(node)
        elif tag == "FAIL":
            result.failures.setdefault(node, []).append(rest)
        elif tag == "SKIP":
            result.skipped.setdefault(node, []).append(rest)
        elif tag == "NOTE":
            result.notes.setdefault(node, []).append(rest)
        elif tag == "PORT" and rest.isdigit() and 0 < int(rest) < 65536:
            result.ports[node] = int(rest)
    result.silent = [n for n in nodes if n not in result.answered]
    return result


def run(identity: JobIdentity, settings: LaunchSettings, env: Mapping[str, str], *,
        python: str = sys.executable,
        runner: Callable[..., tuple[int | None, str]] = run_bounded) -> PreflightResult:
    rc, output = runner(srun_argv(identity, settings, python), settings.preflight_timeout_s, env)
    return parse(output, identity.nodes, rc=rc)


def check_name(detail: str) -> str:
    """``disk: 0.1 GiB free`` -> ``disk``."""
    return detail.split(":", 1)[0].strip()


def job_checks(details: Sequence[str]) -> set[str]:
    return {check_name(d) for d in details} & JOB_CHECKS


def earlier_failures(run_dir: Path, identity: JobIdentity) -> dict[str, set[str]]:
    """node -> the job checks that failed there in an earlier try of this job (its journal's
    ``template`` ``exclude`` lines, from the journal's last ``HISTORY_BYTES``). Best effort: an
    unreadable journal is no history."""
    try:
        fd = os.open(RunDir(run_dir).events, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o170000 != 0o100000:
            return {}
        start = max(0, st.st_size - HISTORY_BYTES)
        data = os.pread(fd, HISTORY_BYTES, start)
    except OSError:
        return {}
    finally:
        os.close(fd)
    if start:
        data = data[data.find(b"\n") + 1:]
    found: dict[str, set[str]] = {}
    for line in data.decode("utf-8", errors="replace").splitlines():
        event = journal.parse_line(line)
        if (event is None or event.kind != journal.TEMPLATE or event.get("action") != "exclude"
                or event.get("job_id") != identity.slurm_id):
            continue
        node, evidence, restart = event.get("node"), event.get("evidence"), event.get("restart_count")
        if (isinstance(node, str) and isinstance(evidence, str) and isinstance(restart, int)
                and restart < identity.restart_count):
            found.setdefault(node, set()).update(job_checks(evidence.split("; ")))
    return found


def jobs_own_failure(result: PreflightResult, nodes: Sequence[str],
                     earlier: Mapping[str, set[str]]) -> str | None:
    """One line when the pre-flight failed for a reason of the job's own (see the module's
    docstring), else None: the failing nodes are to blame."""
    failed = {node: job_checks(details) for node, details in result.failures.items()}
    if not failed:
        return None
    if len(nodes) > 1 and set(failed) == set(nodes):
        shared = set.intersection(*failed.values())
        if shared:
            check = sorted(shared)[0]
            return (f"the pre-flight's {check} check failed on every node of the job "
                    f"({result.failures[nodes[0]][0]}): a problem of the job, not of its nodes")
    for node, checks in sorted(failed.items()):
        for other, before in sorted(earlier.items()):
            both = checks & before
            if other != node and both:
                check = sorted(both)[0]
                detail = next(d for d in result.failures[node] if check_name(d) == check)
                return (f"the pre-flight's {check} check failed on {node} ({detail}) as it did on "
                        f"{other} in an earlier try: a problem of the job, not of its nodes")
    return None
