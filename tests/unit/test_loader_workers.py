"""A DataLoader's workers through a preemption's TERM sent to the rank's whole process group, as
Slurm's cgroup/linuxproc proctrack sends it to every process of a step: with
``slurmft.train.loader_worker_init`` they live on, batches keep coming, and the rank still ends
(its workers too) without closing its loader; without it torch's worker dies of the TERM and the
rank fails before it can save."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from slurmft.train.loader_workers import LoaderWorkerInit, loader_worker_init

RANK = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    from slurmft.train import PreemptionHandler, loader_worker_init

    class Numbers(Dataset):
        def __len__(self):
            return 10**6
        def __getitem__(self, i):
            time.sleep(0.005)
            return torch.tensor([i])

    with PreemptionHandler(parent_poll_s=None) as handler:
        loader = DataLoader(Numbers(), batch_size=4, num_workers=2, multiprocessing_context="fork",
                            persistent_workers=True,
                            worker_init_fn=None if sys.argv[1] == "without" else loader_worker_init)
        batches = iter(loader)
        for _ in range(3):  # batches come from workers 0, 1, 0: both have run their init
            next(batches)
        if sys.argv[1] == "quiet":  # no preemption: the rank just ends, its loader still open
            print("the rank ends")
            sys.exit(0)
        try:  # torch raises a dead worker's error wherever the rank is, from its SIGCHLD handler
            # every process of the step, from outside it, as slurmstepd sends it
            subprocess.run([sys.executable, "-c", "import os, signal, sys; "
                            "os.killpg(int(sys.argv[1]), signal.SIGTERM)", str(os.getpgrp())],
                           start_new_session=True, check=True, timeout=60)
            deadline = time.monotonic() + 60
            while handler.received is None and time.monotonic() < deadline:
                time.sleep(0.01)
            for _ in range(20):
                next(batches)
        except (RuntimeError, ConnectionError) as exc:  # torch's error, or the dead worker's pipe
            print("rank failed:", type(exc).__name__, exc)
            sys.exit(3)
        print("batches still flow; the rank saw", handler.received.name)
    # ends without closing the loader, as after an emergency save: multiprocessing's exit hook
    # terminates the workers (a TERM from their rank) and joins them without a bound
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("init", ["with", "without", "quiet"])
def test_the_workers_live_through_a_term_to_the_whole_group_only_with_the_init(init, tmp_path):
    # TMPDIR: a worker ended by its rank's TERM (torch's handler or the init) skips the exit hook
    # that removes its multiprocessing temp dir (``pymp-*``): here, not /tmp
    proc = subprocess.run([sys.executable, "-c", RANK, init], capture_output=True, text=True,
                          timeout=150, start_new_session=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    if init == "with":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == "batches still flow; the rank saw SIGTERM"
    elif init == "quiet":  # the workers still end when their rank does, without a preemption
        assert (proc.returncode, proc.stdout.strip()) == (0, "the rank ends"), proc.stderr[-2000:]
    else:  # what the init is for: torch's worker dies of the TERM, the rank with it
        assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-2000:])
        assert proc.stdout.startswith(("rank failed: RuntimeError DataLoader worker",
                                       "rank failed: ConnectionResetError")), proc.stdout


def _seed(worker_id):
    print("then", worker_id, flush=True)


def _worker(init_pickled, ready):
    pickle.loads(init_pickled)(7)  # as a spawn or forkserver worker gets it
    ready.set()
    while True:
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_term_from_a_stranger_is_ignored_one_from_the_rank_ends_the_worker_with_0(capfd):
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    worker = ctx.Process(target=_worker, args=(pickle.dumps(LoaderWorkerInit(_seed)), ready))
    worker.start()
    try:
        assert ready.wait(60), "the worker never ran its init"
        status = open(f"/proc/{worker.pid}/status").read()
        ignored = int(status.split("SigIgn:")[1].split()[0], 16)
        assert ignored & (1 << (signal.SIGUSR2 - 1))
        os.kill(worker.pid, signal.SIGUSR2)
        subprocess.run(["kill", "-TERM", str(worker.pid)], check=True, timeout=30)  # a stranger's TERM
        worker.join(2)
        assert worker.exitcode is None, "a TERM from another process ended the worker"
        os.kill(worker.pid, signal.SIGTERM)  # its rank's, as multiprocessing's terminate() sends
        worker.join(60)
        assert worker.exitcode == 0
    finally:
        if worker.exitcode is None:
            worker.kill()
            worker.join(10)
    assert capfd.readouterr().out == "then 7\n"
    assert pickle.loads(pickle.dumps(loader_worker_init)).then is None
    with pytest.raises(TypeError, match="'then' must be callable, got int"):
        LoaderWorkerInit(3)  # type: ignore[arg-type]
