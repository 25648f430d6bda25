"""``python -m slurmft.launch.task TORCHRUN_ARGV...``: one node's task of the training step.

torchrun dies on SIGUSR2's default action and orphans its ranks, so it is started with USR2
ignored; the ranks install their own handler (``slurmft.train.preemption``). The node that hosts
the rendezvous store (node 0 of the step) says so with ``--rdzv-conf=is_host=1``.
"""

from __future__ import annotations

import os
import signal
import sys


def argv_for_node(argv: list[str], node_id: str | None) -> list[str]:
    is_host = "1" if node_id == "0" else "0"
    return [*argv[:3], f"--rdzv-conf=is_host={is_host}", *argv[3:]]


def main() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    argv = sys.argv[1:]
    if len(argv) < 3:
        sys.exit("slurmft.launch.task: expected PYTHON -m torch.distributed.run ARGS...")
    full = argv_for_node(argv, os.environ.get("SLURM_NODEID"))
    os.execv(full[0], full)


if __name__ == "__main__":
    main()
