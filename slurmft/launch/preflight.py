"""The pre-flight: ``nodecheck`` on every node of the allocation in ONE bounded ``srun``, and the
verdict: which nodes to exclude, with the evidence for each.

Only two things exclude a node: a check that ran there and failed (a ``FAIL`` line), or a node
that did not answer (no ``DONE`` line) within the bound. A check that could not give a verdict
(``SKIP``: a busy sweep, a sweep without a report) is reported, never held against the node. If
NO node answered, the pre-flight itself could not run (srun refused, the step was signalled):
nothing is excluded and the job is requeued as it is.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from slurmft.launch.identity import JobIdentity
from slurmft.launch.procs import run_bounded
from slurmft.launch.settings import LaunchSettings

# nodecheck's own deadline is this much shorter than srun's, so a slow node still reports.
NODE_MARGIN_S = 5.0


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
