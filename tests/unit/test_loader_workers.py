"""A DataLoader's workers through a preemption's TERM sent to the rank's whole process group, as
Slurm's cgroup/linuxproc proctrack sends it to every process of a step: with
``slurmft.train.loader_worker_init`` they live on, batches keep coming, and the rank still ends
(its workers too) without closing its loader; without it torch's worker dies of the TERM and the
rank fails before it can save."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest

from slurmft.train.loader_workers import LoaderWorkerInit, loader_worker_init

RANK = textwrap.dedent("""
    import os, signal, sys, time
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
                            worker_init_fn=loader_worker_init if sys.argv[1] == "with" else None)
        batches = iter(loader)
        for _ in range(3):  # batches come from workers 0, 1, 0: both have run their init
            next(batches)
        try:  # torch raises a dead worker's error wherever the rank is, from its SIGCHLD handler
            os.killpg(os.getpgrp(), signal.SIGTERM)  # every process of the step, as slurmstepd does
            deadline = time.monotonic() + 60
            while handler.received is None and time.monotonic() < deadline:
                time.sleep(0.01)
            for _ in range(20):
                next(batches)
        except RuntimeError as exc:
            print("rank failed:", exc)
            sys.exit(3)
        print("batches still flow; the rank saw", handler.received.name)
    # ends without closing the loader, as after an emergency save: multiprocessing's exit hook
    # terminates the workers (a second TERM) and joins them without a bound
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("init", ["with", "without"])
def test_the_workers_live_through_a_term_to_the_whole_group_only_with_the_init(init):
    proc = subprocess.run([sys.executable, "-c", RANK, init], capture_output=True, text=True,
                          timeout=150, start_new_session=True)
    if init == "with":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == "batches still flow; the rank saw SIGTERM"
    else:  # what the init is for: torch's worker dies of the TERM, the rank with it
        assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-2000:])
        assert "rank failed: DataLoader worker" in proc.stdout


def _seed(worker_id):
    os.environ["SLURMFT_TEST_WORKER"] = str(worker_id)


def test_the_init_ignores_both_signals_then_runs_the_users_own_and_pickles():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        init = pickle.loads(pickle.dumps(LoaderWorkerInit(_seed)))  # as spawn/forkserver send it
        init(7)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)  # the first passes; a second would end the worker
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert os.environ.pop("SLURMFT_TEST_WORKER") == "7"
        assert pickle.loads(pickle.dumps(loader_worker_init)).then is None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    with pytest.raises(TypeError, match="'then' must be callable, got int"):
        LoaderWorkerInit(3)  # type: ignore[arg-type]
