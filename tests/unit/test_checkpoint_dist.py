"""Multi-process checkpoint tests on gloo/CPU: resharding, bit-exact resume, kill -9 at every phase.

Each test starts real ranks (tests/helpers/ckpt_worker.py) on a free 127.0.0.1 port, forked from
the pytest worker's warm servers (tests/helpers/warm_ranks.py: the cold start's argv, env and
stdio; a SIGKILL goes to the rank itself); every wait has a timeout and every process is killed
(by pid) before the test returns.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurmft.rundir import RunDir
from slurmft.checkpoint.manifest import read_manifest
from slurmft.checkpoint.verify import verify_checkpoint
from slurmft.checkpoint.tiers import local_checkpoints, read_tier_index
from slurmft.checkpoint.writer import FAULT_DELAY_ENV, FAULT_ENV, FAULT_MARK_ENV, PHASES
from slurmft.launch import nodecheck

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
pytest_plugins = ("warm_ranks",)
if TYPE_CHECKING:
    from warm_ranks import WarmRanks
WORKER = HELPERS / "ckpt_worker.py"
COMMITTED_AT = {"renamed", "committed"}  # phases at which the paused save is already committed
# Liveness bound for two ranks to start (two `import torch`) and reach a mark: a trial missed 90 s
# at load 29 (a fresh-clone run beside four engineers' tests).
STARTUP_S = 240


def free_port() -> int:
    """Below the ephemeral range: a port bound later by the ranks, which another worker's
    connections must not take in between (slurmft.launch.nodecheck.free_port)."""
    return nodecheck.free_port()


def start(ranks: WarmRanks, world: int, args: list[str], extra_env: dict[str, str] | None = None
          ) -> list[subprocess.Popen]:
    """Start ``world`` ranks; each one's output goes to a log file next to --out."""
    port = free_port()
    log_dir = Path(args[args.index("--out") + 1]).parent / "logs"
    log_dir.mkdir(exist_ok=True)
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        for key in (FAULT_ENV, FAULT_MARK_ENV, FAULT_DELAY_ENV):
            env.pop(key, None)
        env.update(extra_env or {})
        with open(log_dir / f"{port}-rank{rank}.log", "wb") as log:
            proc = ranks.popen([sys.executable, str(WORKER), *args], env=env, rank=rank, stdout=log,
                               stderr=subprocess.STDOUT)
        proc.log_path = log.name  # type: ignore[attr-defined]
        procs.append(proc)
    return procs


def logs(procs: list[subprocess.Popen]) -> str:
    return "\n----\n".join(Path(p.log_path).read_text(errors="replace")[-3000:] for p in procs)


def run(ranks: WarmRanks, world: int, args: list[str], timeout: float = 120, expect_rc: int = 0,
        extra_env: dict[str, str] | None = None) -> None:
    procs = start(ranks, world, args, extra_env)
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                ranks.kill_all(procs)
                raise AssertionError(f"ranks did not finish in {timeout}s:\n{logs(procs)}") from None
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != expect_rc]
        assert not bad, f"ranks exited {bad}:\n{logs(procs)}"
    finally:
        ranks.kill_all(procs)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(300)
def test_reshard_fsdp2_4_3_2_4(tmp_path, warm_ranks):
    out = tmp_path / "out.jsonl"
    for world in (4, 3, 2, 4):
        run(warm_ranks, world, ["reshard", "--run-dir", str(tmp_path), "--out", str(out)])
    results = records(out)
    assert [(r["world"], r["loaded"], r["saved"]) for r in results] == [
        (4, None, 1), (3, 1, 2), (2, 2, 3), (4, 3, 4)]
    assert all(r["mismatches"] == [] for r in results), results
    # The sampler's global offset survives every world-size change: 6 samples/rank/step.
    assert [r["offset"] for r in results] == [24, 42, 54, 78]
    for step in RunDir(tmp_path).committed_steps():
        assert verify_checkpoint(RunDir(tmp_path).checkpoint(step)).ok


@pytest.mark.timeout(240)
def test_killed_and_resumed_run_has_identical_losses(tmp_path, warm_ranks):
    steps = 9
    ref, resumed = tmp_path / "ref.jsonl", tmp_path / "resumed.jsonl"
    run(warm_ranks, 2, ["determinism", "--run-dir", str(tmp_path / "a"), "--out", str(ref), "--steps", str(steps)])
    run(warm_ranks, 2, ["determinism", "--run-dir", str(tmp_path / "b"), "--out", str(resumed), "--steps", str(steps),
            "--kill-at", "7"], expect_rc=-signal.SIGKILL)
    killed_at = len(records(resumed))
    run(warm_ranks, 2, ["determinism", "--run-dir", str(tmp_path / "b"), "--out", str(resumed), "--steps", str(steps)])
    reference = {r["step"]: r for r in records(ref)}
    second = records(resumed)[killed_at:]
    assert killed_at == 7 and second[0]["step"] in (5, 7)  # resumed from step 4 or 6
    assert [r["step"] for r in second] == list(range(second[0]["step"], steps + 1))
    for r in second:
        assert r == reference[r["step"]], (r, reference[r["step"]])


@pytest.mark.timeout(120)
def test_busy_skip_is_agreed_by_all_ranks(tmp_path, warm_ranks):
    out = tmp_path / "out.jsonl"
    run(warm_ranks, 2, ["skip", "--run-dir", str(tmp_path), "--out", str(out), "--steps", "40"], timeout=90,
        extra_env={FAULT_DELAY_ENV: "0.01"})  # slow saves: most requests find one in flight
    rank0, rank1 = records(out)[0]["views"]
    assert rank0 == rank1
    assert rank0["skipped"] > 0 and rank0["saved"] == rank0["committed"]
    assert rank0["saved"][0] == 1 and len(rank0["saved"]) >= 3 and len(rank0["saved"]) + rank0["skipped"] == 40
    assert RunDir(tmp_path).committed_steps() == rank0["saved"]


def _committed_state(run_dir: Path) -> int | None:
    """Newest committed step, after asserting that every committed checkpoint verifies."""
    steps = RunDir(run_dir).committed_steps()
    for step in steps:
        report = verify_checkpoint(RunDir(run_dir).checkpoint(step))
        assert report.ok, report.problems
    return steps[-1] if steps else None


def _wait_for(ranks: WarmRanks, path: Path, procs: list[subprocess.Popen], timeout: float, *, nonempty: bool = False) -> None:
    deadline = time.monotonic() + timeout
    # A fault mark is created, then its line is written: wait for the line (once seen empty).
    while not (path.exists() and (not nonempty or path.stat().st_size > 0)):
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            ranks.kill_all(procs)
            raise AssertionError(f"{path.name} never appeared (exits {dead}):\n{logs(procs)}")
        time.sleep(0.02)


@pytest.mark.timeout(1200)
def test_kill_9_at_any_moment_leaves_newest_committed_loadable(tmp_path, warm_ranks):
    rng = random.Random(7)
    run_dir, out = tmp_path / "run", tmp_path / "out.jsonl"
    # Every phase once (pausing there for the kill), plus kills at random moments (each trial
    # starts two torch processes: ~4 s on 2 cores, so the suite keeps 11, not 20).
    trials: list[str | None] = list(PHASES) + [None] * 4
    expected_loaded: int | None = None
    for i, phase in enumerate(trials):
        mark, ready = tmp_path / f"mark{i}", tmp_path / f"ready{i}"
        env = {FAULT_MARK_ENV: str(mark)}
        if phase:
            env[FAULT_ENV] = phase
        else:
            env[FAULT_DELAY_ENV] = "0.02"
        procs = start(warm_ranks, 2, ["crash", "--run-dir", str(run_dir), "--out", str(out), "--ready", str(ready)], env)
        try:
            if phase:
                _wait_for(warm_ranks, mark, procs, timeout=STARTUP_S, nonempty=True)
                paused_step = int(mark.read_text().split()[1])
            else:
                _wait_for(warm_ranks, ready, procs, timeout=STARTUP_S)
                time.sleep(rng.uniform(0, 0.4))
        finally:
            warm_ranks.kill_all(procs)
        loaded_now = records(out)[i]
        assert loaded_now["loaded"] == expected_loaded, (i, phase, loaded_now)
        assert loaded_now["params_ok"] and loaded_now["offset_ok"], loaded_now
        newest = _committed_state(run_dir)
        if phase:
            before = expected_loaded or 0
            assert paused_step == before + 1
            assert newest == (paused_step if phase in COMMITTED_AT else expected_loaded), (phase, newest)
        else:
            assert newest is not None and newest >= (expected_loaded or 0) + 2
        expected_loaded = newest
    # Last start: rank 1's shard of the newest checkpoint is corrupted. Whichever rank hashes it,
    # both must skip it together and load the one before; saving that step again replaces it.
    steps = RunDir(run_dir).committed_steps()
    assert steps[-1] == expected_loaded and len(steps) >= 2
    shard = RunDir(run_dir).checkpoint(steps[-1]) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    procs = start(warm_ranks, 2, ["crash", "--run-dir", str(run_dir), "--out", str(out), "--ready", str(tmp_path / "end")])
    try:
        _wait_for(warm_ranks, tmp_path / "end", procs, timeout=STARTUP_S)
    finally:
        warm_ranks.kill_all(procs)
    final = records(out)[len(trials)]
    assert final["loaded"] == steps[-2] and final["params_ok"], final
    assert _committed_state(run_dir) >= steps[-2] + 2  # and every committed checkpoint verifies


@pytest.mark.timeout(300)
def test_public_torch_paths_round_trip_fsdp2_across_world_sizes(tmp_path, warm_ranks):
    # Every private torch API replaced by its public path (slurmft.checkpoint.torch_compat), DTensor
    # staging included: a 2-rank FSDP2 checkpoint loads on 3 ranks and back, bit-exact.
    out = tmp_path / "out.jsonl"
    for world in (2, 3):
        run(warm_ranks, world, ["reshard", "--run-dir", str(tmp_path), "--out", str(out)],
            extra_env={"SLURMFT_TORCH_PUBLIC_ONLY": "1"})
    results = records(out)
    assert [(r["world"], r["loaded"], r["saved"]) for r in results] == [(2, None, 1), (3, 1, 2)]
    assert all(r["mismatches"] == [] for r in results), results
    for step in RunDir(tmp_path).committed_steps():
        assert verify_checkpoint(RunDir(tmp_path).checkpoint(step)).ok


@pytest.mark.timeout(180)
def test_overlapped_copy_holds_its_steps_state_while_the_next_step_runs_at_once(tmp_path, warm_ranks):
    out = tmp_path / "out.jsonl"
    run(warm_ranks, 2, ["overlap", "--run-dir", str(tmp_path), "--out", str(out)], timeout=150)
    result = records(out)[0]
    assert result["committed"] and result["loaded"] == 2
    assert result["moved"]  # the next step changed parameters and Adam state...
    assert result["mismatches"] == []  # ...yet step 2 holds the state after step 2, bit for bit
    # save() returned before the (slowed, 1 s) copy; Adam's pre-hook then waited for it.
    assert result["blocking_s"] < 1.0 < result["copied_s"]
    assert result["fenced_s"] > 0
    # A parameter (the DTensor) changed on rank 1 without fence(): the save fails on both ranks.
    assert result["unfenced_failed_everywhere"] and not result["step4"]
    assert "changed while checkpoint save of step 4 was still copying it" in result["unfenced_error"]


@pytest.mark.timeout(240)
def test_incremental_fsdp2_saves_reference_the_frozen_base_and_reshard_2_to_3(tmp_path, warm_ranks):
    out = tmp_path / "out.jsonl"
    run(warm_ranks, 2, ["incremental", "--run-dir", str(tmp_path), "--out", str(out)])
    run(warm_ranks, 3, ["incremental", "--run-dir", str(tmp_path), "--out", str(out)])
    first, second = records(out)
    assert (first["world"], first["loaded"], second["world"], second["loaded"]) == (2, None, 3, 2)
    assert first["mismatches"] == [] and second["mismatches"] == []
    for result in (first, second):  # per rank 0: a whole save, then one without the frozen base
        (whole, again), (none, reused) = result["written"], result["reused"]
        assert none == 0 and reused > 0 and again < 0.3 * whole, result  # the rest: RNG, sampler, zip headers
    run_dir = RunDir(tmp_path)
    assert [read_manifest(run_dir.checkpoint(s)).referenced_steps for s in (1, 2, 3, 4)] == [
        frozenset(), {1}, frozenset(), {3}]
    for step in run_dir.committed_steps():
        assert verify_checkpoint(run_dir.checkpoint(step)).ok


def _tiered(run_dir: Path, out: Path, local: Path, nodes: str, steps: int) -> list[str]:
    return ["tiered", "--run-dir", str(run_dir), "--out", str(out), "--local-dir", str(local / "{node}"),
            "--shared-interval", "4", "--nodes", nodes, "--steps", str(steps)]


def _tier_records(out: Path, skip: int) -> tuple[dict, list[tuple[int, str]]]:
    first, *saves = records(out)[skip:]
    assert all(r["committed"] and r["error"] is None for r in saves), saves
    return first, [(r["step"], r["tier"]) for r in saves]


@pytest.mark.timeout(300)
def test_local_tier_resumes_newer_than_the_run_dir_after_losing_a_node_and_its_disk(tmp_path, warm_ranks):
    run_dir, out, local = tmp_path / "run", tmp_path / "out.jsonl", tmp_path / "local"
    # Three ranks on two nodes: a holds ranks 0 and 1, b rank 2.
    run(warm_ranks, 3, _tiered(run_dir, out, local, "a,a,b", 6))
    loaded, saves = _tier_records(out, 0)
    assert loaded["loaded"] is None
    # The first save, and one at least 4 steps after the last copied, reach the run dir.
    assert saves == [(1, "shared"), (2, "local"), (3, "local"), (4, "local"), (5, "shared"), (6, "local")]
    assert RunDir(run_dir).committed_steps() == [1, 5]
    assert read_tier_index(RunDir(run_dir)) == {"a": (5, 6), "b": (5, 6)}  # keep_local = 2
    for node in ("a", "b"):  # its own shards and the other node's replica: all of them, here
        ckpt = local_checkpoints(str(local / "{node}"), run_dir, node) / "step_000000006"
        assert verify_checkpoint(ckpt).ok
    # Node a dies with its disk; the job comes back on a new node c and on b. Step 6 exists only
    # on b (b's own shard and a's replica): c's ranks get what their load reads from b.
    shutil.rmtree(local / "a")
    run(warm_ranks, 3, _tiered(run_dir, out, local, "c,c,b", 8))
    loaded, saves = _tier_records(out, 7)
    assert (loaded["loaded"], loaded["mismatches"]) == (6, [])
    assert saves == [(7, "shared"), (8, "local")]  # a process's first save is copied
    for step in RunDir(run_dir).committed_steps():
        assert verify_checkpoint(RunDir(run_dir).checkpoint(step)).ok
    leftovers = [p.name for p in local.glob("*/*/checkpoints/*") if ".tmp-" in p.name]
    assert leftovers == []  # the fetched files went with the load


@pytest.mark.timeout(300)
def test_node_killed_before_its_copy_to_the_run_dir_resumes_from_the_peer_replica(tmp_path, warm_ranks):
    run_dir, out, local, mark = tmp_path / "run", tmp_path / "out.jsonl", tmp_path / "local", tmp_path / "mark"
    procs = start(warm_ranks, 2, _tiered(run_dir, out, local, "a,b", 8), {FAULT_ENV: "shared_copy@5", FAULT_MARK_ENV: str(mark)})
    try:
        _wait_for(warm_ranks, mark, procs, timeout=120, nonempty=True)  # step 5: committed locally, half copied
    finally:
        warm_ranks.kill_all(procs)
    assert RunDir(run_dir).committed_steps() == [1]
    assert [p.name.split(".")[0] for p in (run_dir / "checkpoints").glob("*.tmp-*")] == ["step_000000005"]
    # Node b is gone with its disk; a restarts beside a new node c. Step 5 lives only on a:
    # a's own shard and its replica of b's.
    shutil.rmtree(local / "b")
    seen = len(records(out))
    run(warm_ranks, 2, _tiered(run_dir, out, local, "a,c", 6))
    loaded, saves = _tier_records(out, seen)
    assert (loaded["loaded"], loaded["mismatches"]) == (5, [])
    assert saves == [(6, "shared")]
    assert RunDir(run_dir).committed_steps() == [1, 6]  # the abandoned copy of 5 was swept
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000000001", "step_000000006"]


@pytest.mark.timeout(120)
def test_a_local_dir_shared_by_two_nodes_is_refused_on_every_rank(tmp_path, warm_ranks):
    out = tmp_path / "out.jsonl"
    args = ["tiered", "--run-dir", str(tmp_path / "run"), "--out", str(out), "--local-dir", str(tmp_path / "nvme"),
            "--nodes", "a,b", "--steps", "2"]
    procs = start(warm_ranks, 2, args)
    try:
        for proc in procs:
            proc.wait(timeout=90)
        text = logs(procs)
        assert [p.returncode for p in procs] == [1, 1], text
        assert text.count("is one directory on nodes a, b: it must be node-local or contain {node}") == 2, text
    finally:
        warm_ranks.kill_all(procs)
