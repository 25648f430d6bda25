"""Plain torchrun, no Slurm: SIGUSR2 to torchrun's process group (how a user tests preemption by
hand) kills torchrun, whose ranks run in their own sessions and never see the signal. Each rank
notices its launcher is gone, and together they save an emergency checkpoint and end with 85
(requeue me) instead of training on to the end (tests/helpers/trap_worker.py, gloo/CPU).

Every wait has a timeout and every process is killed (by pid) before the test returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import alive, json_lines, wait_until
from slurmft import exitcodes
from slurmft.journal import read_events
from slurmft.rundir import RunDir, read_done
from slurmft.launch import nodecheck

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "trap_worker.py"


def _free_port() -> int:
    """Below the ephemeral range: a port bound later by the ranks, which another worker's
    connections must not take in between (slurmft.launch.nodecheck.free_port)."""
    return nodecheck.free_port()


ORPHAN_BOUND_S = 30.0  # from the killpg to every rank gone


@pytest.mark.timeout(300)
def test_sigusr2_to_torchruns_process_group_ends_every_rank_with_an_emergency_checkpoint(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURMFT_RUN_DIR", "SLURM_PROCID", "SLURM_NTASKS")}
    # TMPDIR: torchrun killed leaves its log dir (``torchelastic_*``) in the temp dir: here, not /tmp
    env.update(OMP_NUM_THREADS="1", SLURM_JOB_ID="78", TMPDIR=str(tmp_path))
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(WORKER),
         "--run-dir", str(run_dir), "--out", str(out), "--loop", "clean", "--steps", "1000",
         "--ckpt-every", "500", "--sleep", "0.1"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "torchrun.err", "wb"),
        start_new_session=True)  # its own process group, as a shell's job is
    pids: list[int] = []
    try:
        ranks = [Path(f"{out}.rank{r}") for r in range(2)]
        wait_until("both ranks to train 3 steps", lambda: all(len(json_lines(p)) >= 4 for p in ranks), 180, poll=0.2)
        pids = [json_lines(p)[0]["pid"] for p in ranks]
        sent = time.monotonic()
        os.killpg(torchrun.pid, signal.SIGUSR2)  # what `kill -USR2 -<pgid>` does
        torchrun.wait(timeout=60)
        wait_until("every rank to exit", lambda: not any(alive(pid) for pid in pids), 120, poll=0.2)
        gone_s = time.monotonic() - sent
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait(timeout=30)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    # Issue 30: "within seconds". The ranks see it at their next parent poll (0.5 s) and step
    # boundary (0.1 s steps), then save and exit: a liveness bound, generous for a loaded 2-core box.
    assert gone_s < ORPHAN_BOUND_S, f"the ranks took {gone_s:.1f} s to exit after their launcher was killed"
    events = RunDir(run_dir).events
    (preempted,) = read_events(events, ["preemption"])
    assert preempted.get("signal") == "launcher gone", preempted.fields
    step = preempted.get("step")
    assert step < 1000 and read_done(RunDir(run_dir)) is None
    assert step in [e.get("step") for e in read_events(events, ["checkpoint_committed"])]
    assert RunDir(run_dir).committed_steps()[-1] == step
    (end,) = read_events(events, ["segment_end"])
    assert end.get("exit_code") == exitcodes.REQUEUE, end.fields
