"""``Run`` on 2 real ranks (gloo/CPU, tests/helpers/run_worker.py): resume equals an uninterrupted
run, a preemption seen by one rank ends both with one emergency save and a journaled 85, the guard
judges identical values on every rank, and the final save and DONE happen once.

Every wait has a timeout and every process is killed (by pid) before a test returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurmft import exitcodes
from slurmft.journal import read_events
from slurmft.rundir import RunDir, read_done
from slurmft.launch import nodecheck

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
pytest_plugins = ("warm_ranks",)
if TYPE_CHECKING:
    from warm_ranks import WarmRanks
WORKER = HELPERS / "run_worker.py"
# A liveness bound for two ranks to start (`import torch` each), run and exit: 120 s was missed at
# load 29 (a fresh-clone run beside four engineers' tests).
STARTUP_S = 300


def _free_port() -> int:
    """Below the ephemeral range: a port bound later by the ranks, which another worker's
    connections must not take in between (slurmft.launch.nodecheck.free_port)."""
    return nodecheck.free_port()


def run_ranks(ranks: WarmRanks, tmp_path: Path, run_dir: Path, args: list[str], *, timeout: float = STARTUP_S,
              one_node_each: bool = False) -> list[tuple[int, str]]:
    """Start 2 ranks, wait for both; returns (exit code, stderr) per rank. ``one_node_each``:
    each rank is its node's only rank (nodes n0, n1), so each writes a heartbeat."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "77"}
        if one_node_each:
            env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", SLURMD_NODENAME=f"n{rank}")
        env.pop("SLURMFT_RUN_DIR", None)
        err = open(tmp_path / f"{port}-rank{rank}.err", "w+b")
        proc = ranks.popen([sys.executable, str(WORKER), "--run-dir", str(run_dir),
                            "--out", str(tmp_path / "out"), *args],
                           env=env, rank=rank, stdout=subprocess.DEVNULL, stderr=err)
        procs.append((proc, err))
    deadline = time.monotonic() + timeout
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ranks did not finish in {timeout:.0f} s") from None
    finally:
        ranks.kill_all([proc for proc, _ in procs])
    results = []
    for proc, err in procs:
        err.seek(0)
        results.append((proc.returncode, err.read().decode(errors="replace")))
        err.close()
    return results


def journal_losses(run_dir: Path) -> dict[int, float]:
    found: dict[int, float] = {}
    for event in read_events(RunDir(run_dir).events, ["loss"]):
        assert event.get("step") not in found, f"step {event.get('step')} journaled twice"
        found[event.get("step")] = event.get("loss")
    return found


def rank_records(tmp_path: Path, rank: int) -> list[dict]:
    path = tmp_path / f"out.rank{rank}"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_exits(results, code: int) -> None:
    assert [rc for rc, _ in results] == [code, code], "\n----\n".join(err[-3000:] for _, err in results)


@pytest.mark.timeout(900)
def test_preempted_and_resumed_run_equals_uninterrupted_one(warm_ranks, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    (tmp_path / "ref-out").mkdir()
    assert_exits(run_ranks(warm_ranks, tmp_path / "ref-out", ref, []), 0)
    # Rank 1 alone sees the signal in step 6: both ranks agree, save step 6 once and exit 85.
    first = run_ranks(warm_ranks, tmp_path, run, ["--signal-at", "6"])
    assert_exits(first, exitcodes.REQUEUE)
    ends = read_events(RunDir(run).events, ["segment_end"])
    assert [(e.get("exit_code"), e.get("step")) for e in ends] == [(exitcodes.REQUEUE, 6)]
    # Journaled by rank 0, which saw nothing itself: the reason the ranks agreed on, not "peer".
    assert [(e.get("step"), e.get("signal")) for e in read_events(RunDir(run).events, ["preemption"])] \
        == [(6, "SIGUSR2")]
    assert RunDir(run).committed_steps() == [4, 6]
    # Quiet: one line from rank 0 for the whole job, no traceback anywhere.
    stderr = first[0][1] + first[1][1]
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("slurmft:")]
    assert lines == ["slurmft: 2 rank(s): preempted: emergency checkpoint at step 6 -> REQUEUE (85)"], stderr

    assert_exits(run_ranks(warm_ranks, tmp_path, run, []), 0)
    starts = read_events(RunDir(run).events, ["segment_start"])
    assert [s.get("restored_step") for s in starts] == [None, 6]
    assert starts[1].get("load_bytes") > 0 and starts[1].get("load_s") > 0
    assert starts[0].get("load_bytes") == 0
    got, want = journal_losses(run), journal_losses(ref)
    assert sorted(got) == list(range(1, 13))
    assert got == want  # bit for bit: same floats from JSON


@pytest.mark.timeout(900)
def test_final_save_and_done_happen_once_also_when_preempted_in_the_last_step(warm_ranks, tmp_path):
    run = tmp_path / "run"
    # Rank 1 sees a preemption signal in the last step: the run finishes (the final save, DONE,
    # exit 0) instead of an emergency save and 85, which would requeue a segment only to write DONE.
    assert_exits(run_ranks(warm_ranks, tmp_path, run, ["--steps", "6", "--signal-at", "6"]), 0)
    assert read_events(RunDir(run).events, ["preemption"]) == []
    first_end = read_events(RunDir(run).events, ["segment_end"])[0]
    assert "a preemption signal, SIGUSR2, came in the last step" in first_end.text("reason"), first_end
    done = RunDir(run).done
    marker = read_done(RunDir(run))
    assert (marker.step, marker.total_steps) == (6, 6)
    stamp = done.stat().st_mtime_ns
    assert RunDir(run).committed_steps() == [4, 6]
    commits = len(read_events(RunDir(run).events, ["checkpoint_committed"]))
    # Started again after it finished (a requeue that raced the end): no step, no save, DONE kept.
    assert_exits(run_ranks(warm_ranks, tmp_path, run, ["--steps", "6"]), 0)
    assert done.stat().st_mtime_ns == stamp
    assert len(read_events(RunDir(run).events, ["checkpoint_committed"])) == commits
    assert sorted(journal_losses(run)) == list(range(1, 7))
    ends = read_events(RunDir(run).events, ["segment_end"])
    assert [(e.get("exit_code"), e.get("step")) for e in ends] == [(0, 6), (0, 6)]


@pytest.mark.timeout(900)
def test_guard_judges_identical_values_on_every_rank(warm_ranks, tmp_path):
    # Only rank 1's loss and gradients are NaN in step 3: both ranks must skip that update.
    run = tmp_path / "run"
    assert_exits(run_ranks(warm_ranks, tmp_path, run, ["--steps", "8", "--nan-at", "3"]), 0)
    rank0, rank1 = rank_records(tmp_path, 0), rank_records(tmp_path, 1)
    assert len(rank0) == 8 and rank0 == rank1  # same loss, norm and verdict bits on both ranks
    assert [r["verdict"] for r in rank0] == ["ok", "ok", "skip", *["ok"] * 5]
    trips = read_events(RunDir(run).events, ["guard_trip"])
    assert [(t.get("step"), t.get("verdict")) for t in trips] == [(3, "skip")]
    assert journal_losses(run)[3] is None


@pytest.mark.timeout(900)
def test_repeated_trouble_gives_up_with_86_journaled(warm_ranks, tmp_path):
    run = tmp_path / "run"
    results = run_ranks(warm_ranks, tmp_path, run, ["--steps", "8", "--nan-at", "2", "--nan-at", "3",
                                        "--max-trips", "2"])
    assert_exits(results, exitcodes.NO_REQUEUE)
    end = read_events(RunDir(run).events, ["segment_end"])[-1]
    assert (end.get("exit_code"), end.get("step")) == (exitcodes.NO_REQUEUE, 3)
    assert not RunDir(run).done.exists()
    assert "Traceback" not in results[0][1] + results[1][1]


@pytest.mark.timeout(900)
def test_rollback_reloads_the_last_checkpoint_and_replays(warm_ranks, tmp_path):
    run = tmp_path / "run"
    assert_exits(run_ranks(warm_ranks, tmp_path, run, ["--steps", "8", "--nan-at", "6",
                                           "--guard-action", "rollback"]), 0)
    rolls = read_events(RunDir(run).events, ["rollback"])
    assert [(r.get("from_step"), r.get("to_step")) for r in rolls] == [(6, 4)]
    steps = [r["step"] for r in rank_records(tmp_path, 0)]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # steps 5-6 replayed after the rollback


def test_each_node_beats_its_own_forward_time_and_the_slow_one_stands_out(warm_ranks, tmp_path):
    # Every rank's wall step time is the same (the DDP all-reduce waits for the slow one); the
    # forward time in each node's heartbeat is what tells the straggler apart.
    from slurmft.watch.runview import read_heartbeats

    run_dir = tmp_path / "run"
    results = run_ranks(warm_ranks, tmp_path, run_dir, ["--steps", "6", "--slow-rank", "1", "--slow-s", "0.3"],
                        one_node_each=True)
    assert [code for code, _ in results] == [0, 0], results
    beats = read_heartbeats(RunDir(run_dir))
    assert sorted(beats) == ["n0", "n1"]
    # 0.3 s more per forward on n1; n0's tiny forward stays far below even on a loaded box
    assert beats["n1"].busy_s >= 0.3 and beats["n1"].busy_s > 3 * beats["n0"].busy_s, beats
