#!/usr/bin/env python3
"""How long torchrun's re-formation after each fence took, and why, from a job's log.

    TORCH_LOGS="+torch.distributed.elastic.rendezvous.dynamic_rendezvous" \
        python benchmarks/soak.py ...            # or recovery_bench.py: sbatch passes it on
    python benchmarks/rdzv_log.py WORK/job.log [--json]

The job's log then holds torch's rendezvous debug lines beside the launcher's. After each
fence of an active node (the launcher's ``-> replaced by the spare`` or ``-> dropped: ...``)
this reads the re-formation: the first agent's "attempts to join the next round", the round's
"has joined round N" lines, and every "has a stale state and failed to sync" between them: a
compare-and-set of torch's whole rendezvous state that lost to another agent's write (most
often a waiting agent's keep-alive). The agent whose join completes the round must win one:
when it loses again and again, the round, and the recovery, wait (``launch/nodesteps.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

# V1127 07:09:47.007000 10116 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1191] ...
TORCH_LINE = re.compile(r"^[VIWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) \d+ \S*dynamic_rendezvous\.py:\d+\] "
                        r"(.*)$")
FENCE_LINE = re.compile(r"^slurmft-launch\[[^\]]* (\d\d):(\d\d):(\d\d)\]: (\S+) (\S+): .* -> "
                        r"(replaced by the spare \S+|dropped: training goes on on \d+ node\(s\))")
NODE = re.compile(r"The node '([^']+)'")
JOINED = re.compile(r"has joined round (\d+) .* as rank (\d+) in a world of size (\d+)")
COMPLETED = re.compile(r"marked round (\d+) of the rendezvous \S+ as complete")


def _seconds(h: str, m: str, s: str) -> float:
    return int(h) * 3600 + int(m) * 60 + float(s)


@dataclass
class Reform:
    """One re-formation after a fence (times in seconds after the fence's whole second)."""
    fenced: str
    cause: str
    action: str
    first_join_s: float | None = None
    joined_s: float | None = None       # the last agent of the new round returned from its join
    round: int | None = None
    world_size: int | None = None
    completed_by: str | None = None     # the agent whose write completed the round
    lost_writes: int = 0                # "stale state" between the first join and the last joined
    lost_by: dict[str, int] = field(default_factory=dict)
    joins: int = 0                      # agents that returned from their join of that round

    @property
    def closed(self) -> bool:
        """Every agent of the new round has returned from its join."""
        return self.world_size is not None and self.joins >= self.world_size

    @property
    def round_s(self) -> float | None:
        if self.first_join_s is None or self.joined_s is None:
            return None
        return round(self.joined_s - self.first_join_s, 3)


def reforms(lines: list[str]) -> list[Reform]:
    out: list[Reform] = []
    fence_t = 0.0
    lost: Counter[str] = Counter()
    for line in lines:
        fence = FENCE_LINE.match(line)
        if fence:
            fence_t = _seconds(*fence.group(1, 2, 3))
            out.append(Reform(fenced=fence.group(4), cause=fence.group(5), action=fence.group(6)))
            lost = Counter()
            continue
        torch_line = TORCH_LINE.match(line)
        if not out or not torch_line:
            continue
        reform, text = out[-1], torch_line.group(4)
        at = round(_seconds(*torch_line.group(1, 2, 3)) - fence_t, 3)
        node = NODE.search(text)
        if "attempts to join the next round" in text and reform.first_join_s is None:
            reform.first_join_s = at
        if reform.first_join_s is None or reform.closed:
            continue
        if "stale state and failed to sync" in text and node:
            lost[node.group(1)] += 1
            reform.lost_writes, reform.lost_by = sum(lost.values()), dict(lost)
        completed = COMPLETED.search(text)
        if completed and node:
            reform.completed_by = node.group(1)
        joined = JOINED.search(text)
        if joined:
            reform.joined_s = at
            reform.round, reform.world_size = int(joined.group(1)), int(joined.group(3))
            reform.joins += 1
    return out


def render(rows: list[Reform]) -> str:
    out = ["| fenced | cause | first join (s) | round joined (s) | round took (s) | lost writes "
           "| completed by (its lost writes) |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        def num(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"
        done = "-" if r.completed_by is None else f"{r.completed_by} ({r.lost_by.get(r.completed_by, 0)})"
        out.append(f"| {r.fenced} | {r.cause} | {num(r.first_join_s)} | {num(r.joined_s)} "
                   f"| {num(r.round_s)} | {r.lost_writes} | {done} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", type=Path, help="the job's log (its --output)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        lines = args.log.read_text(errors="replace").splitlines()
    except OSError as exc:
        print(f"rdzv_log: {args.log}: {exc.strerror}", file=sys.stderr)
        return 1
    rows = reforms(lines)
    if not rows:
        print(f"rdzv_log: {args.log}: no fence by the in-allocation launcher", file=sys.stderr)
        return 1
    if not any(r.first_join_s is not None for r in rows):
        print(f"rdzv_log: {args.log}: no torch rendezvous debug lines (set TORCH_LOGS="
              "\"+torch.distributed.elastic.rendezvous.dynamic_rendezvous\")", file=sys.stderr)
        return 1
    print(json.dumps([{**asdict(r), "round_s": r.round_s} for r in rows], sort_keys=True)
          if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
