"""What ``recovery_bench.py`` reports: the summary of its trials (one per SlurmdTimeout, and the
keys of issue 27 across them) and its markdown tables. Also reads the older single-timeout JSON
(``--tables FILE`` on a result saved before issue 27)."""

from __future__ import annotations

from _recovery_trial import IN_ALLOCATION, MODES, NODES, REQUEUES

SPARE_TARGET_S = 15.0
# issue 27's JSON keys: (fault, mode) whose recovery time each one is, per SlurmdTimeout
ISSUE_KEYS = {"requeue_node_death_s": ("node_death", "watch"),
              "slurm_alone_node_death_s": ("node_death", "slurm"),
              "inalloc_node_death_s": ("node_death", "inalloc"),
              "inalloc_shrink_s": ("node_death", "shrink"),
              "inalloc_crash_s": ("crash", "inalloc"),
              # beyond the issue's keys: a dead node that closes no socket (see _recovery_trial)
              "inalloc_node_freeze_s": ("node_freeze", "inalloc"),
              "requeue_node_freeze_s": ("node_freeze", "watch"),
              # a frozen rank on a healthy node, restarted in place (the ranks' watchdog)
              "inalloc_hang_s": ("hang", "inalloc"),
              # a node lost in the allocation with no spare left (the spare used): the requeue
              "inalloc_requeue_node_death_s": ("node_death", "spent"),
              "inalloc_spare_then_node_death_s": ("node_death", "spare2")}
# The requeue's phases (``Trial.phases``), each in seconds after the fault, in order.
REQUEUE_PHASES = ("detected", "launcher_requeue", "left_running", "pending", "watch_start_now",
                  "running_again", "segment_start", "training_again", "node_down")


def timeout_summary(results: list[dict], slurmd_timeout: int, cap: float) -> dict:
    """One SlurmdTimeout's trials and the figures the tables and targets read."""
    by = {(r["fault"], r["mode"]): r for r in results}
    summary: dict = {"slurmd_timeout_s": slurmd_timeout, "cap_s": cap, "trials": results}

    def get(fault: str, mode: str, key: str = "recover_s"):
        return by.get((fault, mode), {}).get(key)

    if ("node_death", "watch") in by:
        w, s = get("node_death", "watch"), get("node_death", "slurm")
        summary["node_death_s"] = w
        summary["slurm_alone_node_death_s"] = s
        summary["node_death_ratio"] = w / s if w and s else None
        summary["node_death_down_to_running_s"] = get("node_death", "watch", "down_to_running_s")
    if ("node_death", "operator") in by:
        op = summary["operator_node_death_s"] = get("node_death", "operator")
        plain = summary.get("node_death_s")
        summary["operator_saves_s"] = plain - op if plain is not None and op is not None else None
    if ("hang", "watch") in by:
        summary["hang_recovered"] = get("hang", "watch", "recovered")
        summary["hang_detect_s"] = get("hang", "watch", "detect_s")
        summary["slurm_alone_hang_recovered"] = get("hang", "slurm", "recovered")
    if ("crash", "watch") in by:
        summary["crash_recovered"] = get("crash", "watch", "recovered")
        summary["slurm_alone_crash_recovered"] = get("crash", "slurm", "recovered")
    for key, (fault, mode) in ISSUE_KEYS.items():
        if (fault, mode) in by:
            summary[key] = get(fault, mode)
    phases = next((r["restart_phases"] for r in results
                   if r["mode"] in IN_ALLOCATION and r.get("restart_phases")), None)
    summary["restart_phases"] = phases
    return summary


def issue_keys(runs: list[dict]) -> dict:
    """Issue 27's keys, each {SlurmdTimeout (str): seconds or None}, present when measured. A
    timeout run more than once (``--slurmd-timeout 10 10``) gives its worst trial (None, not
    recovered, is the worst), and ``KEY_trials`` lists every trial's figure in run order."""
    out: dict = {}
    for key in ISSUE_KEYS:
        trials: dict[str, list] = {}
        for run in runs:
            if key in run:
                trials.setdefault(str(run["slurmd_timeout_s"]), []).append(run[key])
        if trials:
            out[key] = {t: worst(v) for t, v in trials.items()}
            if any(len(v) > 1 for v in trials.values()):
                out[f"{key}_trials"] = trials
    phases = {str(run["slurmd_timeout_s"]): run["restart_phases"] for run in runs
              if "restart_phases" in run}
    if phases:
        out["restart_phases"] = phases
    return out


def worst(values: list):
    return None if any(v is None for v in values) else max(values)


def merge(outputs: list[dict]) -> dict:
    """Several saved ``--json`` outputs as one (runs of the same SlurmdTimeout joined, trials in
    the order given; a later trial of the same fault and mode replaces an earlier one)."""
    if not outputs:
        raise ValueError("nothing to merge")
    by_timeout: dict[int, dict] = {}
    for out in outputs:
        for run in out.get("runs") or []:
            t = run["slurmd_timeout_s"]
            into = by_timeout.setdefault(t, {"trials": {}, "cap_s": run["cap_s"], "loads": []})
            for trial in run["trials"]:
                into["trials"][(trial["fault"], trial["mode"])] = trial
            into["cap_s"] = max(into["cap_s"], run["cap_s"])
            into["loads"] += [run.get("loadavg_1m_start"), run.get("loadavg_1m_end")]
    runs = []
    for t, into in sorted(by_timeout.items()):
        run = timeout_summary(list(into["trials"].values()), t, into["cap_s"])
        loads = [x for x in into["loads"] if x is not None]
        run["loadavg_1m_start"] = min(loads) if loads else None
        run["loadavg_1m_end"] = max(loads) if loads else None
        runs.append(run)
    first = outputs[0]
    cycle = next((o["cycle"] for o in outputs if o.get("cycle")), None)
    merged = {"poll_s": first["poll_s"], "hang_timeout_s": first["hang_timeout_s"],
              "nodes": first.get("nodes"), "slurmd_timeouts": sorted(by_timeout),
              "loadavg_1m": max(o.get("loadavg_1m") or 0 for o in outputs),
              "merged_from": len(outputs), "runs": runs, "cycle": cycle, **issue_keys(runs)}
    if cycle:
        merged["cycle_cpu_s_1000_jobs"] = cycle["cpu_s"]
        merged["cycle_queries_1000_jobs"] = cycle["queries"]
    return merged


def fmt(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))


def print_tables(summary: dict) -> None:
    """The markdown tables of a run (also from a saved ``--json`` output: ``--tables FILE``)."""
    runs = summary.get("runs") or [summary]  # before issue 27: one timeout, its keys at the top
    print(f"recovery benchmark: poll {summary['poll_s']:g} s, hang timeout "
          f"{summary['hang_timeout_s']:g} s, {summary.get('nodes', 2)} training node(s), 1-min load "
          f"{fmt(summary.get('loadavg_1m'))} at the end")
    for run in runs:
        print_run(run, summary)
    cycle = summary.get("cycle")
    if cycle:
        print(f"\n| a watcher cycle with {cycle['jobs']} jobs queued: < 0.2 s CPU, <= 2 controller "
              f"calls | {cycle['cpu_s']:.3f} s CPU (+ {cycle['slurm_commands_cpu_s']:.3f} s in "
              f"squeue/scontrol), {cycle['queries']} calls ({', '.join(cycle['commands'])}) | "
              f"{'yes' if cycle['cpu_s'] < 0.2 and cycle['queries'] <= 2 else 'NO'} |")
    spare = summary.get("inalloc_node_death_s")
    if spare:
        values = [v for v in spare.values()]
        met = bool(values) and all(v is not None and v <= SPARE_TARGET_S for v in values)
        print(f"\n| node death recovered by a spare <= {SPARE_TARGET_S:g} s at every SlurmdTimeout | "
              + ", ".join(f"{fmt(v)} s at {t} s" for t, v in spare.items())
              + f" | {'yes' if met else 'NO'} |")


def print_run(run: dict, summary: dict) -> None:
    results = run["trials"]
    load = run.get("loadavg_1m_start")
    print(f"\nSlurmdTimeout {run.get('slurmd_timeout_s', 10):g} s, cap {run['cap_s']:g} s"
          + (f", 1-min load {load:.1f} to {run['loadavg_1m_end']:.1f}"
             if load is not None else "") + "\n")
    print("| fault | mode | recovered | fault -> detected s | fault -> training again s | "
          "back at step (restored) | world | DOWN -> RUNNING s | job states polled |")
    print("| --- | --- | --- | ---: | ---: | --- | ---: | ---: | --- |")
    for r in results:
        back = r.get("back") or {}
        at = (f"{back['step']} ({back['restored_step']})" if back.get("step") is not None else "-")
        recovered = "yes" if r["recovered"] else (f"no: {r['ended']}" if r.get("ended")
                                                  else "not run" if r.get("error")
                                                  else "no (after cap)")
        print(f"| {r['fault']} | {MODES[r['mode']]} | {recovered} | {fmt(r['detect_s'])} | "
              f"{fmt(r['recover_s'])} | {at} | {fmt(back.get('world_size'))} | "
              f"{fmt(r.get('down_to_running_s'))} | {','.join(r.get('job_states_seen', [])) or '-'}"
              + (f" (requeues {r['restart_count']})" if r.get("restart_count") is not None else "")
              + " |")
    print()
    print("| target | measured | met |")
    print("| --- | --- | --- |")
    ratio = run.get("node_death_ratio")
    if ratio is not None or run.get("slurm_alone_node_death_s") is not None:
        print(f"| node death <= 0.20 x Slurm alone (requeue path) | {'-' if ratio is None else f'{ratio:.2f}'} "
              f"({fmt(run.get('node_death_s'))} s vs {fmt(run.get('slurm_alone_node_death_s'))} s) | "
              f"{'yes' if ratio is not None and ratio <= 0.2 else 'NO'} |")
    if run.get("operator_saves_s") is not None:
        print(f"| (no target) what --operator saves on a node death | {fmt(run['operator_saves_s'])} s "
              f"({fmt(run['operator_node_death_s'])} s vs {fmt(run['node_death_s'])} s) | - |")
    if "hang_recovered" in run:
        limit = summary["hang_timeout_s"] + 2 * summary["poll_s"]
        d = run["hang_detect_s"]
        print(f"| hang detected <= timeout + 2 polls ({limit:g} s) after the stop, and recovered; "
              f"Slurm alone never | {fmt(d)} s, recovered {run['hang_recovered']}, Slurm alone "
              f"{run.get('slurm_alone_hang_recovered')} | "
              f"{'yes' if run['hang_recovered'] and d is not None and d <= limit else 'NO'} |")
    if "crash_recovered" in run:
        print(f"| crash recovered; Slurm alone never | {run['crash_recovered']}, Slurm "
              f"alone {run['slurm_alone_crash_recovered']} | "
              f"{'yes' if run['crash_recovered'] else 'NO'} |")
    for r in results:
        if r["mode"] not in IN_ALLOCATION or r["mode"] in REQUEUES:  # a requeue by design
            continue
        stayed = r.get("job_states_seen") == ["RUNNING"]
        back = r.get("back") or {}
        checks = [stayed, bool(r.get("at_restored_step"))]
        if r["mode"] == "shrink" and r["fault"] == "node_death":
            checks.append(back.get("world_size") == NODES - 1)
        if r["mode"] == "inalloc" and r["fault"] in ("node_death", "node_freeze"):
            checks.append(r["recover_s"] is not None and r["recover_s"] <= SPARE_TARGET_S)
        print(f"| {r['fault']}, {MODES[r['mode']]}: job never left RUNNING, back at the restored "
              f"step{', <= 15 s' if r['mode'] == 'inalloc' and r['fault'] != 'crash' else ''} | "
              f"states {','.join(r.get('job_states_seen', []))}, {fmt(r['recover_s'])} s, "
              f"fenced {r.get('fenced')} | {'yes' if all(checks) else 'NO'} |")
    requeues = [r for r in results if r.get("requeue_phases")]
    if requeues:
        print("\nrequeue phases, seconds after the fault (the journal, the job's states as polled, "
              "the node's DOWN):\n")
        print("| fault | mode | " + " | ".join(REQUEUE_PHASES) + " |")
        print("| --- | --- |" + " ---: |" * len(REQUEUE_PHASES))
        for r in requeues:
            ph = r["requeue_phases"]
            print(f"| {r['fault']} | {MODES[r['mode']]} | "
                  + " | ".join(fmt(ph.get(k)) for k in REQUEUE_PHASES) + " |")
    phases = run.get("restart_phases")
    if phases:
        print("\nrestart phases (the ranks' restart_phases event of the in-allocation recovery): "
              + ", ".join(f"{k} {fmt(v)}" for k, v in phases.items() if k.endswith("_s")))
