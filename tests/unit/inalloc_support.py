"""What the unit tests of the in-allocation supervisor share: a step per node that beats."""

from __future__ import annotations

import json
import sys
import time

from slurmft.launch import nodesteps, procs
from slurmft.rundir import RunDir


def start_beating_steps(sup, run: RunDir, nodes) -> None:
    """Give ``sup`` a live stand-in step (a sleeping process) on each node, each with a first
    beat in its alive file naming step ids 10, 11, ...; the caller polls ``sup.liveness``."""
    for step_id, node in enumerate(nodes, start=10):
        proc = procs.start([sys.executable, "-c", "import time; time.sleep(60)"])
        sup.steps[node] = nodesteps.NodeStep(node, proc, time.monotonic())
        run.alive(node).parent.mkdir(exist_ok=True)
        sup.liveness.expect(node)
        run.alive(node).write_text(json.dumps({"seq": 1, "pid": 1, "step_id": str(step_id)}))
