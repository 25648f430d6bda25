"""``benchmarks/recovery_bench.py --tables`` on saved real outputs: the single-SlurmdTimeout JSON
of 2026-11-25 and the per-timeout JSON written since issue 27 (a crash trial pair measured
2026-11-26); the issue's keys map each SlurmdTimeout to its figure. Not the numbers themselves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"


def tables(name: str) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / "recovery_bench.py"), "--tables",
                           str(RESULTS / name)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_old_single_timeout_output_still_prints():
    out = tables("recovery_bench_2026-11-25.json")
    assert "| node death <= 0.20 x Slurm alone (requeue path) | 0.20 (36.2 s vs 182.1 s) | yes |" in out
    assert "| node_death | Slurm alone | yes | - | 182.1 |" in out
    assert "2 calls (squeue, sinfo) | yes |" in out


def test_the_per_timeout_output_prints_each_trial_with_where_it_came_back():
    out = tables("recovery_bench_crash_loaded_2026-11-26.json")
    assert "SlurmdTimeout 10 s, cap 240 s" in out
    assert "| crash | slurmft watch (requeue) | yes | 5.8 | 40.2 | 21 (20) | 3 |" in out
    assert "| crash | Slurm alone | no: FAILED |" in out


def test_issue_keys_map_each_slurmd_timeout_to_its_figure():
    sys.path.insert(0, str(BENCH))
    try:
        from _recovery_report import issue_keys, timeout_summary
    finally:
        sys.path.remove(str(BENCH))
    saved = json.loads((RESULTS / "recovery_bench_crash_loaded_2026-11-26.json").read_text())
    trials = saved["runs"][0]["trials"]
    as_inalloc = [{**t, "mode": "inalloc"} for t in trials if t["mode"] == "watch"]
    runs = [timeout_summary(trials + as_inalloc, 10, 240.0),
            timeout_summary([{**t, "recover_s": 2 * t["recover_s"]} for t in as_inalloc], 120, 460.0)]
    keys = issue_keys(runs)
    assert keys["inalloc_crash_s"] == {"10": trials[0]["recover_s"], "120": 2 * trials[0]["recover_s"]}
    assert "requeue_node_death_s" not in keys  # not measured: absent, never a made-up figure


def test_merging_outputs_joins_runs_of_one_timeout_and_keeps_the_later_trial():
    sys.path.insert(0, str(BENCH))
    try:
        from _recovery_report import merge
    finally:
        sys.path.remove(str(BENCH))
    saved = json.loads((RESULTS / "recovery_bench_crash_loaded_2026-11-26.json").read_text())
    later = json.loads(json.dumps(saved))
    watch = next(t for t in later["runs"][0]["trials"] if t["mode"] == "watch")
    watch["recover_s"] = 1.5
    inalloc = {**watch, "mode": "inalloc", "recover_s": 9.0}
    later["runs"][0]["trials"] = [watch, inalloc]
    merged = merge([saved, later])
    [run] = merged["runs"]
    assert [(t["mode"], t["recover_s"]) for t in run["trials"]] == [
        ("watch", 1.5), ("slurm", None), ("inalloc", 9.0)]
    assert merged["inalloc_crash_s"] == {"10": 9.0} and merged["merged_from"] == 2


def test_a_timeout_given_again_is_a_run_of_its_own_and_its_worst_trial_is_the_issue_key():
    """``--slurmd-timeout 10 10 120 10``: each run gets its own cluster and run dirs (the second
    10 s run reused the first's run dir and failed its pre-flight), and the issue's key at a timeout
    run more than once is its worst trial, every trial listed beside it."""
    sys.path.insert(0, str(BENCH))
    try:
        import recovery_bench
        from _recovery_report import issue_keys, timeout_summary
    finally:
        sys.path.remove(str(BENCH))
    assert recovery_bench.run_names([10, 10, 120, 10]) == ["10", "10-2", "120", "10-3"]
    saved = json.loads((RESULTS / "recovery_bench_crash_loaded_2026-11-26.json").read_text())
    watch = next(t for t in saved["runs"][0]["trials"] if t["mode"] == "watch")
    runs = [timeout_summary([{**watch, "mode": "inalloc", "recover_s": s}], t, 240.0)
            for t, s in ((10, 9.0), (10, 31.0), (120, 11.0), (10, 12.0))]
    keys = issue_keys(runs)
    assert keys["inalloc_crash_s"] == {"10": 31.0, "120": 11.0}
    assert keys["inalloc_crash_s_trials"] == {"10": [9.0, 31.0, 12.0], "120": [11.0]}
    runs.append(timeout_summary([{**watch, "mode": "inalloc", "recover_s": None,
                                  "recovered": False}], 120, 240.0))
    assert issue_keys(runs)["inalloc_crash_s"]["120"] is None  # not recovered is the worst


def test_a_requeue_from_the_allocation_prints_its_phases_and_is_not_judged_as_one_that_stayed():
    """The 'spent' mode (in the allocation, no spare left: a requeue by design), measured before
    the dead node was released from the job (2026-11-27): each phase after the fault, and no
    'job never left RUNNING' target row for it."""
    out = tables("recovery_bench_spent_before_2026-11-27.json")
    assert ("| node_death | in-allocation, no spare left (requeue) | 4.6 | 5.2 | 5.4 | 132.1 | - | "
            "133.6 | 148.8 | 149.2 | 132.1 |") in out
    assert "job never left RUNNING" not in out
    data = json.loads((RESULTS / "recovery_bench_spent_before_2026-11-27.json").read_text())
    sys.path.insert(0, str(BENCH))
    try:
        from _recovery_report import issue_keys, timeout_summary
    finally:
        sys.path.remove(str(BENCH))
    # the keys as a run gives them now (the file was saved before the key was named)
    keys = issue_keys([timeout_summary(r["trials"], r["slurmd_timeout_s"], r["cap_s"]) for r in data["runs"]])
    assert {t: round(v, 1) for t, v in keys["inalloc_requeue_node_death_s"].items()} == \
        {"10": 46.4, "120": 149.2}
