"""The chaos faults find a rank that runs as a warm worker (``SLURMFT_WARM_WORKERS``): torchrun's
rank is then the warm client, and the training runs in a worker the node's warm server forked,
whose /proc cmdline and environ are the server's. Real server, clients and workers (the server
pre-imports ``json`` only: the mechanics are a node's)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from procs import wait_until
from slurmft.chaos import faults
from slurmft.launch import warmclient, warmtask

PY = sys.executable
WAIT_S = 120.0
JOB = {"SLURM_JOB_ID": "424242", "SLURM_CLUSTER_NAME": "chaoswarm"}

pytestmark = pytest.mark.timeout(240)


def test_a_warm_rank_is_found_with_its_worker_and_only_its_own(tmp_path):
    sock_dir = tempfile.mkdtemp(prefix="slurmft-warm-test-", dir="/tmp")
    sock = os.path.join(sock_dir, "s")
    server = subprocess.Popen([PY, "-m", "slurmft.launch.warm", "--socket", sock, "--imports", "json"],
                              env={**os.environ, **JOB}, stderr=subprocess.DEVNULL)
    script = tmp_path / "train.py"
    script.write_text("import os, time\n"
                      "open(os.environ['PID_FILE'], 'w').write(str(os.getpid()))\n"
                      "time.sleep(120)\n")
    clients = []
    try:
        for rank in (0, 1):
            err = open(tmp_path / f"rank{rank}.err", "w")  # torchrun --redirects: a file per rank
            clients.append(subprocess.Popen(
                [PY, "-I", "-S", warmclient.__file__, "--", str(script)],
                env={**os.environ, **JOB, "RANK": str(rank), warmclient.SOCKET_ENV: sock,
                     "PID_FILE": str(tmp_path / f"rank{rank}.pid")}, stderr=err))
        pids = {r: tmp_path / f"rank{r}.pid" for r in (0, 1)}
        wait_until("both workers' pids", lambda: all(p.exists() and p.read_text() for p in pids.values()))
        workers = {r: int(p.read_text()) for r, p in pids.items()}
        assert workers[1] not in (c.pid for c in clients)  # forked by the server, not the client

        found = faults.rank_pids("chaoswarm", "424242", script, rank=1)
        assert sorted(found) == sorted([clients[1].pid, workers[1]])
        # A hang stops the training (the worker), not slurmft's client: a hung rank's client
        # still runs, and ends the frozen worker when torchrun stops the world.
        assert faults.rank_pids("chaoswarm", "424242", script, rank=1, training_only=True) == [workers[1]]
        every = faults.rank_pids("chaoswarm", "424242", script)
        assert sorted(every) == sorted([c.pid for c in clients] + list(workers.values()))
        assert faults.rank_pids("othercluster", "424242", script) == []
    finally:
        for c in clients:
            c.kill()
            c.wait(30)
        warmtask.stop_server(server, sock)
