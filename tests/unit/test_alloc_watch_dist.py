"""In-allocation mode on 3 real ranks (gloo/CPU, tests/helpers/run_worker.py, one "node" each):
a peer that stops answering (SIGSTOP: a node that is powered off or cut off sends no RST) leaves
the survivors inside a gloo all-reduce that cannot be aborted; once the launcher moves the
allocation's generation they exit 88 within seconds, not at the collective timeout (30 min) nor
at the step watchdog's (120 s here), with the segment's end journaled. The re-formed world (a
spare in the lost node's place, torchrun's next attempt) resumes from the newest checkpoint and
trains exactly what an uninterrupted run trains.

The test writes allocation.json with slurmft.allocation's writer, as the launcher does: the
launcher's own side is tested on the devcluster (tests/integration/test_inalloc.py). Every wait
is bounded and every process is killed (by pid) before a test returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurmft import allocation, exitcodes
from slurmft.journal import read_events
from slurmft.launch import nodecheck
from slurmft.rundir import RunDir

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
pytest_plugins = ("warm_ranks",)
if TYPE_CHECKING:
    from warm_ranks import WarmRanks
WORKER = HELPERS / "run_worker.py"
JOB = "77"


def write_allocation(run_dir: Path, generation: int, active: list[str], fenced: list[str] = ()) -> None:
    allocation.write(RunDir(run_dir), allocation.Allocation(
        job_id=JOB, generation=generation, active=tuple(active), spares=(),
        fenced=tuple(allocation.Fence(node=n, cause="node_silent", time=time.time(),
                                      evidence=(f"{n}: no heartbeat",)) for n in fenced),
        min_nodes=2))


class Ranks:
    """3 ranks, rank r on node ``nodes[r]``, forked warm; stderr of each kept for the assertions."""

    def __init__(self, warm: WarmRanks, tmp_path: Path, run_dir: Path, nodes: list[str], args: list[str], *,
                 attempt: int | list[int] = 0, env: dict[str, str] | None = None) -> None:
        """``attempt``: torchrun's restart count, one for all or one per rank (per agent)."""
        port = nodecheck.free_port()
        attempts = attempt if isinstance(attempt, list) else [attempt] * len(nodes)
        extra = env or {}
        self.out = tmp_path / f"out{max(attempts)}"
        self.warm = warm
        self.errs, self.procs = [], []
        for rank, node in enumerate(nodes):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": JOB, "SLURMFT_JOB_ID": JOB,
                   "SLURMD_NODENAME": node, "TORCHELASTIC_RESTART_COUNT": str(attempts[rank])}
            env.pop("SLURMFT_RUN_DIR", None)
            env.update(extra)
            err = open(tmp_path / f"{port}-rank{rank}.err", "w+b")
            self.errs.append(err)
            self.procs.append(warm.popen(
                [sys.executable, str(WORKER), "--run-dir", str(run_dir), "--out", str(self.out), *args],
                env=env, rank=rank, stdout=subprocess.DEVNULL, stderr=err))

    def steps_done(self, rank: int) -> int:
        path = Path(f"{self.out}.rank{rank}")
        return len(path.read_text().splitlines()) if path.exists() else 0

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while min(self.steps_done(r) for r in range(len(self.procs))) < step:
            dead = [p.returncode for p in self.procs if p.poll() is not None]
            assert not dead, f"a rank exited {dead} before step {step}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"the ranks did not reach step {step} in {timeout:.0f} s"
            time.sleep(0.1)

    def wait(self, ranks: list[int], timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for rank in ranks:
            try:
                self.procs[rank].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} did not exit within {timeout:.0f} s:\n"
                                     f"{self.stderr()}") from None
        return [self.procs[r].returncode for r in ranks]

    def stderr(self, rank: int | None = None) -> str:
        texts = []
        for r, err in enumerate(self.errs):
            if rank is None or r == rank:
                err.seek(0)
                texts.append(err.read().decode(errors="replace")[-3000:])
        return "\n----\n".join(texts)

    def send_signal(self, rank: int, sig: int) -> None:
        """``sig`` to the rank's own process (not its warm client)."""
        self.warm.send_signal(self.procs[rank], sig)

    def kill(self) -> None:
        self.warm.kill_all(self.procs)
        for err in self.errs:
            err.close()


def journal_losses(run_dir: Path) -> dict[int, float]:
    """The loss journaled for each step, the latest one where a step was trained again."""
    return {e.get("step"): e.get("loss") for e in read_events(RunDir(run_dir).events, ["loss"])}


@pytest.mark.timeout(300)
def test_survivors_stuck_in_gloo_exit_88_within_seconds_of_the_new_generation(tmp_path, warm_ranks):
    run = tmp_path / "run"
    run.mkdir()
    write_allocation(run, 1, ["n0", "n1", "n2"])
    ranks = Ranks(warm_ranks, tmp_path, run, ["n0", "n1", "n2"],
                  ["--steps", "100000", "--ckpt-every", "1000", "--step-sleep", "0.2"])
    try:
        ranks.wait_for_step(3)
        ranks.send_signal(2, signal.SIGSTOP)  # n2 stops answering mid-training
        time.sleep(2.0)  # the survivors enter the next all-reduce and block there
        assert ranks.procs[0].poll() is None and ranks.procs[1].poll() is None
        stuck_at = ranks.steps_done(0)
        fenced_at = time.monotonic()
        write_allocation(run, 2, ["n0", "n1"], fenced=["n2"])  # the launcher fences n2
        codes = ranks.wait([0, 1], timeout=60)  # the watchdog (120 s) or gloo (1800 s) otherwise
        took = time.monotonic() - fenced_at
        assert codes == [exitcodes.REFORM, exitcodes.REFORM], ranks.stderr()
        print(f"survivors out {took:.2f} s after the new generation (poll 0.5 s)")
        assert ranks.steps_done(0) == stuck_at  # they were stuck, not training on
        for rank in (0, 1):
            err = ranks.stderr(rank)
            assert "Traceback" not in err, err
            assert (f"slurmft: rank {rank}: the allocation's generation moved from 1 to 2 (fenced: n2)"
                    " -> REFORM (88)") in err, err
        end = read_events(RunDir(run).events, ["segment_end"])[-1]
        assert (end.get("exit_code"), end.get("outcome"), end.get("attempt"), end.get("step")) == (
            exitcodes.REFORM, "REFORM (88)", 0, stuck_at)
    finally:
        ranks.kill()


@pytest.mark.timeout(300)
def test_survivors_whose_collective_failed_at_once_wait_for_the_verdict_and_exit_88(tmp_path, warm_ranks):
    """A killed peer's sockets are closed (its processes died with the node's, or the network
    said so): gloo raises in the survivors at once, before the launcher has fenced anything.
    They wait for its verdict and leave the same way as from a blocked collective. Rank 0 is the
    one killed here: the lowest survivor journals the segment's end in its place."""
    run = tmp_path / "run"
    run.mkdir()
    write_allocation(run, 1, ["n0", "n1", "n2"])
    ranks = Ranks(warm_ranks, tmp_path, run, ["n0", "n1", "n2"],
                  ["--steps", "100000", "--ckpt-every", "1000", "--step-sleep", "0.2"],
                  env={"SLURMFT_NODE_SILENT_S": "40"})
    try:
        ranks.wait_for_step(3)
        ranks.send_signal(0, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not all("waiting up to 45 s for the launcher" in ranks.stderr(r) for r in (1, 2)):
            assert ranks.procs[1].poll() is None and ranks.procs[2].poll() is None, ranks.stderr()
            assert time.monotonic() < deadline, f"the survivors' collective did not fail:\n{ranks.stderr()}"
            time.sleep(0.2)
        write_allocation(run, 2, ["n1", "n2"], fenced=["n0"])  # the launcher's verdict, later
        assert ranks.wait([1, 2], timeout=60) == [exitcodes.REFORM] * 2, ranks.stderr()
        for rank in (1, 2):
            assert "Traceback" not in ranks.stderr(rank), ranks.stderr(rank)
        ends = read_events(RunDir(run).events, ["segment_end"])
        assert [(e.get("exit_code"), e.get("attempt"), e.get("rank")) for e in ends] == [
            (exitcodes.REFORM, 0, 1)]
        assert ends[0].get("reason") == "the allocation's generation moved from 1 to 2 (fenced: n0)"
    finally:
        ranks.kill()


@pytest.mark.timeout(420)
def test_the_reformed_world_resumes_and_trains_what_an_uninterrupted_run_trains(tmp_path, warm_ranks):
    """3 ranks, one replaced by a spare. DDP with find_unused_parameters=True: a new DDP
    instance otherwise rebuilds its buckets and a 3-rank run is ~1e-7 off an uninterrupted one
    after any restart, the requeue path's included (docs/limitations.md); this is the recipe that
    keeps DDP bit-identical, and the test holds it to that."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    (tmp_path / "ref-out").mkdir()
    for d in (ref, run):
        d.mkdir()
        write_allocation(d, 1, ["n0", "n1", "n2"])
    args = ["--steps", "12", "--ckpt-every", "4", "--find-unused"]
    whole = Ranks(warm_ranks, tmp_path / "ref-out", ref, ["n0", "n1", "n2"], args)
    try:
        assert whole.wait([0, 1, 2], timeout=240) == [0, 0, 0], whole.stderr()
    finally:
        whole.kill()

    first = Ranks(warm_ranks, tmp_path, run, ["n0", "n1", "n2"], [*args, "--step-sleep", "0.3"])
    try:
        first.wait_for_step(6)  # checkpoint 4 is committed
        first.send_signal(1, signal.SIGSTOP)  # n1 stops answering
        write_allocation(run, 2, ["n0", "n3", "n2"], fenced=["n1"])  # the spare n3 takes its place
        assert first.wait([0, 2], timeout=60) == [exitcodes.REFORM] * 2, first.stderr()
    finally:
        first.kill()
    # torchrun's next attempt, the rendezvous puts rank 0 on the spare: its agent never restarted
    # (count 0), the survivors' did (1); the world agrees on 1.
    second = Ranks(warm_ranks, tmp_path, run, ["n3", "n0", "n2"], args, attempt=[0, 1, 1])
    try:
        assert second.wait([0, 1, 2], timeout=240) == [0, 0, 0], second.stderr()
    finally:
        second.kill()
    starts = read_events(RunDir(run).events, ["segment_start"])
    assert (starts[0].get("attempt"), starts[0].get("restored_step")) == (0, None)
    assert starts[-1].get("attempt") == 1 and starts[-1].get("restored_step") in (4, 8)
    got, want = journal_losses(run), journal_losses(ref)
    assert sorted(got) == list(range(1, 13)) and got == want  # bit for bit: same floats from JSON
    ends = read_events(RunDir(run).events, ["segment_end"])
    assert [(e.get("attempt"), e.get("exit_code")) for e in ends] == [(0, exitcodes.REFORM), (1, 0)]
    assert json.loads((run / "DONE").read_text())["step"] == 12
    phases = read_events(RunDir(run).events, ["restart_phases"])
    assert [(p.get("attempt"), p.get("step"), p.get("tier"), p.get("world_size")) for p in phases] == [
        (0, 1, None, 3), (1, starts[-1].get("restored_step") + 1, "shared", 3)]
