"""``slurmft interval``: how often to checkpoint (Young's and Daly's optimal interval), from
``--cost`` and ``--mtbf`` (or ``--nodes`` x ``--node-mtbf``), or measured from ``--run-dir``.
Exit codes: 0 printed; 2 bad or missing input (the message names the option)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from slurmft import numbers

EXIT_OK, EXIT_USAGE = 0, 2


def _fail(message: str) -> typer.Exit:
    print(f"slurmft interval: {message}", file=sys.stderr, flush=True)
    return typer.Exit(EXIT_USAGE)


def _measured(run_dir: Path):
    from slurmft.interval import measure
    from slurmft.rundir import RunDir
    from slurmft.status.report import JournalUnreadable, build_report, read_journal

    if not run_dir.is_dir():
        raise _fail(f"--run-dir {run_dir} is not a directory")
    path = RunDir(run_dir).events
    if not path.exists() and not path.is_symlink():
        raise _fail(f"--run-dir {run_dir} is not a slurmft run dir (it has no {path.name})")
    try:
        events = read_journal(path)
    except JournalUnreadable as exc:
        raise _fail(f"cannot read the run's journal: {exc}")
    return measure(events, build_report(events, now=time.time()))


def interval(
    cost: Optional[float] = typer.Option(None, "--cost", help="Seconds one checkpoint stalls training."),
    mtbf: Optional[float] = typer.Option(None, "--mtbf", help="Mean seconds between failures of the job."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Nodes of the job (with --node-mtbf)."),
    node_mtbf: Optional[float] = typer.Option(None, "--node-mtbf", help="Mean seconds between "
                                              "failures of one node."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Measure what is not given "
                                           "from this run's journal."),
    step_time: Optional[float] = typer.Option(None, "--step-time", help="Seconds per step, to "
                                              "print the interval in steps (default: the run's)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Young's and Daly's optimal checkpoint interval: given, or measured from a run dir."""
    from slurmft.interval import IntervalError, compute
    from slurmft.status.render import duration

    measured = _measured(run_dir) if run_dir is not None else None
    try:
        result = compute(cost_s=cost, mtbf_s=mtbf, nodes=nodes, node_mtbf_s=node_mtbf,
                         measured=measured, step_s=step_time)
    except IntervalError as exc:
        raise _fail(str(exc))
    if as_json:
        print(numbers.dumps({
            "cost_s": result.cost_s, "mtbf_s": result.mtbf_s, "young_s": result.young_s,
            "daly_s": result.daly_s, "step_s": result.step_s,
            "young_steps": result.steps(result.young_s), "daly_steps": result.steps(result.daly_s),
            "cost_from": result.cost_from, "mtbf_from": result.mtbf_from}, sort_keys=True))
        return
    print(f"checkpoint cost C = {result.cost_s:.3g} s  ({result.cost_from})")
    print(f"MTBF            M = {result.mtbf_s:.6g} s = {duration(result.mtbf_s)}  ({result.mtbf_from})")
    for name, seconds in (("Young  sqrt(2CM)", result.young_s), ("Daly   higher-order", result.daly_s)):
        steps = result.steps(seconds)
        in_steps = f" = {steps} steps at {result.step_s:.3g} s/step" if steps is not None else ""
        print(f"{name:20s} checkpoint every {seconds:.6g} s = {duration(seconds)}{in_steps}")
    if result.cost_s >= 2 * result.mtbf_s:
        print("note: C >= 2M: checkpoints cost more than failures do; Daly's answer is M itself")
    if result.step_s is None:
        print("(no step time known: give --step-time or --run-dir to see the interval in steps)")


app = interval
