"""The exact resume check on 2 real ranks (gloo/CPU, tests/helpers/trap_worker.py): the two
determinism traps are journaled as ``resume_diverged`` naming the first resumed step, after a
preemption (no step redone) and after ``kill -9`` (steps redone); a loop that resumes bit for bit
(an evaluation drawing from the global RNG after ``optimizer.step()`` included) gets no warning.
A first batch drawn lazily inside step 1 with a prefetch after the forward pass is not caught after
a preemption: a strict xfail holds that limitation (docs/limitations.md) until it is.

Every wait has a timeout and every process is killed (by pid) before a test returns.
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

import slurmft
from slurmft import exitcodes
from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.launch import nodecheck

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
pytest_plugins = ("warm_ranks",)
if TYPE_CHECKING:
    from warm_ranks import WarmRanks
WORKER = HELPERS / "trap_worker.py"
PACKAGE = str(Path(slurmft.__file__).resolve().parent)
# A liveness bound for two ranks to start (`import torch` each), run and exit: 120 s was missed at
# load 29 (a fresh-clone run beside four engineers' tests).
STARTUP_S = 300


def worker_line(marker: str) -> int:
    """The trap worker's line that holds ``marker``."""
    return next(i for i, line in enumerate(WORKER.read_text().splitlines(), 1) if marker in line)


def _free_port() -> int:
    """Below the ephemeral range: a port bound later by the ranks, which another worker's
    connections must not take in between (slurmft.launch.nodecheck.free_port)."""
    return nodecheck.free_port()


def run_ranks(ranks: WarmRanks, tmp_path: Path, run_dir: Path, args: list[str], timeout: float = STARTUP_S,
              world: int = 2) -> list[tuple[int, str]]:
    """Start ``world`` ranks of the trap worker, wait for all: (exit code, stderr) per rank."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "77"}
        env.pop("SLURMFT_RUN_DIR", None)
        err = open(tmp_path / f"{port}-rank{rank}.err", "w+b")
        proc = ranks.popen([sys.executable, str(WORKER), "--run-dir", str(run_dir),
                            "--out", str(tmp_path / run_dir.name), *args],
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


def interrupt(ranks: WarmRanks, tmp_path: Path, run_dir: Path, loop: str, how: str) -> int:
    """Run ``loop`` until a preemption (emergency checkpoint at 5) or a kill -9 in step 5
    (checkpoint 3, steps 4-5 lost); returns the step the next start resumes from."""
    if how == "preempt":
        results = run_ranks(ranks, tmp_path, run_dir, ["--loop", loop, "--signal-at", "4"])
        assert [code for code, _ in results] == [exitcodes.REQUEUE] * 2, results
        return 5
    results = run_ranks(ranks, tmp_path, run_dir, ["--loop", loop, "--die-at", "5"])
    assert any(code == -signal.SIGKILL for code, _ in results), results
    return 3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["preempt", "kill9"])
@pytest.mark.parametrize("loop, cause", [("before_loop", "rng_before_loop"), ("before_run", "stale_inputs")])
def test_each_trap_is_journaled_at_the_first_resumed_step(warm_ranks, tmp_path, loop, cause, how):
    run_dir = tmp_path / "run"
    restored = interrupt(warm_ranks, tmp_path, run_dir, loop, how)
    results = run_ranks(warm_ranks, tmp_path, run_dir, ["--loop", loop])
    assert [code for code, _ in results] == [0, 0], results
    (diverged,) = read_events(RunDir(run_dir).events, ["resume_diverged"])
    assert (diverged.get("step"), diverged.get("cause")) == (restored + 1, cause), diverged.fields
    # The warning is at the user's line that drew the held batch (torch.randn in draw()), names the
    # loop's line that called it (the draw before the loop; the prefetch), and says the step.
    stderr = results[0][1]
    assert f"resume diverged at step {restored + 1}" in stderr, stderr
    draw_site = f"{WORKER}:{worker_line('# DRAW')}"
    assert stderr.split("ResumeDivergenceWarning")[0].splitlines()[-1] == f"{draw_site}: ", stderr
    assert diverged.get("site") == draw_site, diverged.fields
    caller = worker_line("# BEFORE-LOOP" if loop == "before_loop" else "# PREFETCH")
    assert f"{draw_site} (torch, in draw(), called from {WORKER}:{caller}" in diverged.get("message"), diverged.fields
    # attributed to the user's line, never to one of slurmft's own (the loop's or the engine's)
    assert not [line for line in stderr.splitlines() if line.startswith(PACKAGE)], stderr


@pytest.mark.timeout(900)
@pytest.mark.parametrize("loop, how", [("eval", "preempt"), ("eval", "kill9"), ("clean", "kill9"),
                                       ("eval_before", "preempt"), ("eval_before", "kill9")])
def test_a_bit_identical_resume_gets_no_warning(warm_ranks, tmp_path, loop, how):
    # eval_before: a draw between `with Run` and the loop that the loop never reads (its batches
    # from run.rng(step), no dropout): the old code called it rng_before_loop at every resume
    run_dir, reference = tmp_path / "run", tmp_path / "ref"
    interrupt(warm_ranks, tmp_path, run_dir, loop, how)
    results = run_ranks(warm_ranks, tmp_path, run_dir, ["--loop", loop])
    assert [code for code, _ in results] == [0, 0], results
    assert all("ResumeDivergenceWarning" not in err for _, err in results), results
    assert read_events(RunDir(run_dir).events, ["resume_diverged"]) == []
    # and it was bit-identical: every step's loss equals an uninterrupted run's (which, a fresh
    # start, is not warned about either)
    results = run_ranks(warm_ranks, tmp_path, reference, ["--loop", loop])
    assert [code for code, _ in results] == [0, 0], results
    assert all("ResumeDivergenceWarning" not in err for _, err in results), results

    def losses(name: str) -> dict[int, float]:
        rows = [json.loads(line) for line in (tmp_path / f"{name}.rank0").read_text().splitlines()]
        rows = [row for row in rows if "step" in row]
        return {row["step"]: row["loss"] for row in rows}  # a redone step: its last value

    assert losses("run") == losses("ref")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("loop", ["clean", "before_loop"])
def test_on_another_world_size_only_what_can_be_compared_is(warm_ranks, tmp_path, loop):
    # 2 ranks preempted at 5, resumed on 1: the restore reseeds the RNG (another rank's stream has
    # no meaning here) and the batches differ by design, so nothing is "diverged"; a draw between
    # the restore and the loop is still warned about at its line, as on a fresh start.
    run_dir = tmp_path / "run"
    interrupt(warm_ranks, tmp_path, run_dir, loop, "preempt")
    results = run_ranks(warm_ranks, tmp_path, run_dir, ["--loop", loop], world=1)
    assert [code for code, _ in results] == [0], results
    assert read_events(RunDir(run_dir).events, ["resume_diverged"]) == []
    stderr = results[0][1]
    if loop == "clean":
        assert "ResumeDivergenceWarning" not in stderr, stderr
    else:
        draw_site = f"{WORKER}:{worker_line('# DRAW')}"
        assert stderr.split("ResumeDivergenceWarning")[0].splitlines()[-1] == f"{draw_site}: ", stderr
        assert f"called from {WORKER}:{worker_line('# BEFORE-LOOP')}" in stderr, stderr


@pytest.mark.timeout(900)
@pytest.mark.xfail(strict=True, reason="not caught: the first batch drawn lazily inside step 1 and the "
                   "next prefetched after the forward pass, resumed after a preemption (no step redone): "
                   "nothing the interrupted run journaled shows what its step k+1 would have trained on "
                   "(docs/limitations.md)")
def test_a_lazily_drawn_first_batch_with_a_prefetch_is_reported_after_a_preemption(warm_ranks, tmp_path):
    run_dir, reference = tmp_path / "run", tmp_path / "ref"
    restored = interrupt(warm_ranks, tmp_path, run_dir, "lazy_prefetch", "preempt")
    results = run_ranks(warm_ranks, tmp_path, run_dir, ["--loop", "lazy_prefetch"])
    assert [code for code, _ in results] == [0, 0], results
    results = run_ranks(warm_ranks, tmp_path, reference, ["--loop", "lazy_prefetch"])
    assert [code for code, _ in results] == [0, 0], results

    def losses(name: str) -> dict[int, float]:
        rows = [json.loads(line) for line in (tmp_path / f"{name}.rank0").read_text().splitlines()]
        return {row["step"]: row["loss"] for row in rows if "step" in row}

    ours, theirs = losses("run"), losses("ref")
    # the trap is real: equal up to the checkpoint, different from the first resumed step on
    assert all(ours[s] == theirs[s] for s in range(1, restored + 1)), (ours, theirs)
    assert ours[restored + 1] != theirs[restored + 1], (ours, theirs)
    # what is not done yet (the strict xfail fails the moment it is)
    (diverged,) = read_events(RunDir(run_dir).events, ["resume_diverged"])
    assert diverged.get("step") == restored + 1, diverged.fields
