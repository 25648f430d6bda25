"""Numbers and records from outside (issue 26, items 1 and 2): a journal line whose time is a
400-digit integer, NaN or Infinity; a watcher state whose fields have the wrong type; settings of
``inf``/``nan``/``1e300``; command-line values too large to use. Each reader answers with the
value, or "invalid" naming the field (exit 2, one line), never a traceback; every JSON printed is
valid JSON. Each test failed on the code before the fix (the message it failed with is noted)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slurmft import journal, numbers
from slurmft.cli import app
from slurmft.config import ConfigError, load_section
from slurmft.journal import parse_line, read_events, segment_outcome
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobState
from slurmft.slurm.config import SlurmConfig
from slurmft.watch.config import WatchConfig
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import RunState, StateError, load_state, save_state

pytestmark = pytest.mark.timeout(120)

T0 = 1_800_000_000.0
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "journal" / "preempt_crash.events.jsonl"
HUGE = "9" * 400
BAD_TIMES = [HUGE, "NaN", "Infinity", "-Infinity", "1e400", "-5", "1e300", '"12"']


def strict_json(text: str):
    """json.loads that refuses what is not JSON (Python's own accepts NaN and Infinity)."""
    def refuse(name):
        raise AssertionError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def line(t: str, kind: str = "loss", **fields) -> str:
    body = ",".join(f'"{k}":{v}' for k, v in {"job_id": '"7"', "restart_count": "0", **fields}.items())
    return f'{{"v":1,"t":{t},"kind":"{kind}",{body}}}'


def write_journal(run: Path, lines: list[str]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "events.jsonl").write_text("\n".join(lines) + "\n")


def cli(*args, env=None):
    return CliRunner().invoke(app, [*map(str, args)], env={"COLUMNS": "200", **(env or {})})


def one_error_line(result, command: str) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"slurmft {command}: "), result.output
    return lines[0]


# ----------------------------------------------------------------------------- numbers.py


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 10**400, True, "1", None, [1]])
def test_a_value_that_is_not_a_finite_number_is_none_or_names_its_field(value):
    assert numbers.finite(value) is None and numbers.unix_time(value) is None
    with pytest.raises(numbers.InvalidNumber, match=r"^\[x\] y must be "):
        numbers.number(value, "[x] y", lo=0, hi=10)


def test_numbers_in_range_pass_as_plain_types():
    assert numbers.finite(3) == 3.0 and type(numbers.finite(3)) is float
    assert numbers.count(2**63 - 1) == 2**63 - 1 and numbers.count(2**63) is None and numbers.count(-1) is None
    assert numbers.unix_time(T0) == T0 and numbers.unix_time(-1) is None and numbers.unix_time(1e12) is None
    assert numbers.seconds(5) == 5.0 and numbers.seconds(numbers.MAX_SECONDS * 2) is None
    assert numbers.parse_number(" 2.5 ", "X", lo=0, hi=3) == 2.5
    for text in ("inf", "nan", "1e300", "abc", ""):
        with pytest.raises(numbers.InvalidNumber, match="^X must be"):
            numbers.parse_number(text, "X", lo=0, hi=3)
    with pytest.raises(numbers.InvalidNumber, match="at most|<= 5|from 0 to 5"):
        numbers.parse_integer("9" * 30, "N", lo=0, hi=5)


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}', '{"a": 1e400}',
                                  '{"a": ' + "9" * 5000 + "}", "[" * 100_000])
def test_loads_refuses_what_is_not_json_of_finite_numbers(text):
    with pytest.raises(ValueError):
        numbers.loads(text)


def test_dumps_writes_valid_json_whatever_it_is_given():
    text = numbers.dumps({"a": float("nan"), "b": [float("inf"), 1.5], "c": 10**30})
    assert strict_json(text) == {"a": None, "b": [None, 1.5], "c": 10**30}


# ----------------------------------------------------------------------------- the journal
# Before: OverflowError ("int too large to convert to float") out of parse_line for a 400-digit
# t, in every reader; NaN/Infinity times read as events at time nan/inf.


@pytest.mark.parametrize("t", BAD_TIMES)
def test_a_line_whose_time_is_not_a_unix_time_is_skipped(t):
    assert parse_line(line(t)) is None
    assert parse_line(line("12.5")) is not None


@pytest.mark.parametrize("t", [HUGE, "NaN", "Infinity"])
def test_the_templates_outcome_finds_85_after_a_line_with_a_bad_time(tmp_path, capsys, t):
    write_journal(tmp_path, [line(t), line("2", "segment_end", exit_code="85")])
    assert journal.main(["outcome", str(tmp_path), "7", "0"]) == 0
    assert capsys.readouterr().out.strip() == "85"


def test_a_field_holding_nan_makes_the_line_invalid_not_the_reader(tmp_path):
    write_journal(tmp_path, [line("1", "segment_end", exit_code="85", reason="NaN"),
                             line("2", "segment_end", exit_code="85")])
    events = read_events(tmp_path / "events.jsonl")
    assert len(events) == 1 and events[0].time == 2.0
    assert segment_outcome(events, "7", 0) is events[0]


# ----------------------------------------------------------------------------- slurmft status


HOSTILE_FIELDS = [
    line(HUGE), line("NaN"), line("Infinity"),
    line(str(T0 + 1), "segment_start", world_size=HUGE, num_nodes="-2", load_s=HUGE,
         load_bytes=HUGE, restored_step="-3", nodelist="[1,2]"),
    line(str(T0 + 1.5), "segment_start", load_s="NaN"),  # not JSON: the line is skipped
    line(str(T0 + 2), "loss", step=HUGE),
    line(str(T0 + 3), "checkpoint_committed", step="3", blocking_s=HUGE),
    line(str(T0 + 4), "checkpoint_committed", step="4", blocking_s="1e-320"),
    line(str(T0 + 5), "fault_detected", cause="5", evidence="[]", nodes="5", fault_time=HUGE),
    line(str(T0 + 6), "recovery_action", action="[]", ok="true"),
    line(str(T0 + 7), "job_running", start_time="-1e300"),
    line(str(T0 + 8), "watch_warning", what="{}", detail=HUGE, nodes='{"a":1}'),
    line(str(T0 + 9), "watch_started", job_submit_time=HUGE),
    line(str(T0 + 10), "segment_end", exit_code=HUGE, outcome="[1]", reason="{}"),
    line(str(T0 + 11), "gave_up", reason="[1]", held="1"),
]


@pytest.mark.parametrize("as_json", [True, False])
def test_status_over_hostile_numbers_shows_the_run_and_prints_valid_json(tmp_path, as_json):
    """Before: OverflowError (a 400-digit t), "Out of range float values are not JSON
    compliant" (a NaN t under --json), TypeError (nodes that are a number)."""
    write_journal(tmp_path / "run", HOSTILE_FIELDS)
    result = cli("status", tmp_path / "run", "--no-slurm", *(["--json"] if as_json else []))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 0, result.output
    if as_json:
        data = strict_json(result.stdout)
        assert data["segments"][0]["world_size"] is None and data["segments"][0]["load_bytes"] is None
        assert data["faults"][0]["nodes"] == [] and data["faults"][0]["fault_time"] is not None


@pytest.mark.parametrize("t", [HUGE, "NaN", "Infinity"])
def test_status_of_a_real_journal_with_one_bad_time_added(tmp_path, t):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(FIXTURE, run / "events.jsonl")
    with open(run / "events.jsonl", "a") as fh:
        fh.write(line(t) + "\n")
    result = cli("status", run, "--no-slurm", "--json")
    assert result.exit_code == 0, result.output
    assert strict_json(result.stdout)["restarts"] == 2


def _state(**recovery) -> dict:
    state = RunState(job_id="7", phase="recovering", restarts=1)
    data = state.to_json()
    data["recovery"] = {"cause": "crash", "evidence": "exit 1", "fault_time": T0, "detect_time": T0 + 1,
                        "restart_count": 0, **recovery}
    return data


@pytest.mark.parametrize("recovery,field", [
    ({"fault_time": "yesterday"}, "field recovery.fault_time"),
    ({"exclude": 5}, "field recovery.exclude"),
    ({"exclude": ["n1", 2]}, "field recovery.exclude[1]"),
    ({"pending_since": 10**400}, "field recovery.pending_since"),
    ({"start_now_at": -1}, "field recovery.start_now_at"),
    ({"start_now_attempts": -1}, "field recovery.start_now_attempts"),
    ({"silent_since": {"n1": "x"}}, "field recovery.silent_since['n1']"),
    ({"requeue": "maybe"}, "field recovery has an unknown step state"),
    ({"requeued_at": float("nan")}, "not valid JSON (NaN is not a JSON number"),
    ({"cause": float("inf")}, "not valid JSON (Infinity is not a JSON number"),
])
def test_a_watch_state_is_checked_whole_before_it_is_used(tmp_path, recovery, field):
    """Before: a recovery time that is a string loaded, and failed every cycle with TypeError."""
    run = RunDir(tmp_path / "run")
    run.watch_state.parent.mkdir(parents=True)
    run.watch_state.write_text(json.dumps(_state(**recovery)))  # Python writes NaN: a user could
    with pytest.raises(StateError) as caught:
        load_state(run, "7")
    message = str(caught.value)
    assert field in message and str(run.watch_state) in message and len(message.splitlines()) == 1, message


@pytest.mark.parametrize("recovery", [{"exclude": 5}, {"cause": float("nan")}, {"fault_time": "x"},
                                      {"detect_time": 10**400}])
def test_status_shows_a_damaged_watch_state_as_unreadable(tmp_path, recovery):
    """Before: TypeError ('int' object is not iterable) for exclude 5; "Out of range float
    values are not JSON compliant" for cause NaN."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE.parent, run, ignore=lambda d, names: [n for n in names if n != FIXTURE.name])
    (run / FIXTURE.name).rename(run / "events.jsonl")
    RunDir(run).watch_state.parent.mkdir()
    RunDir(run).watch_state.write_text(json.dumps(_state(**recovery)))
    result = cli("status", run, "--no-slurm", "--json")
    assert result.exit_code == 0, result.output
    watcher = strict_json(result.stdout)["watcher"]
    assert watcher["phase"] == "unreadable" and ("recovery." in watcher["reason"]
                                                 or "not valid JSON" in watcher["reason"]), watcher
    table = cli("status", run, "--no-slurm")
    assert table.exit_code == 0 and "unreadable" in table.output, table.output


def test_a_good_watch_state_still_reads_back(tmp_path):
    run = RunDir(tmp_path / "run")
    state = RunState.from_json(_state(exclude=["n2"], requeue="done", silent_since={"n2": T0}), run.watch_state)
    save_state(run, state)
    assert load_state(run, "7") == state


# ----------------------------------------------------------------------------- the watcher


class Client:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def requeue(self, job_id: str) -> bool:
        self.calls.append(("requeue", job_id))
        return True

    def submit_line(self, job_id: str):
        return None


@pytest.mark.parametrize("t", [HUGE, "NaN", "Infinity"])
def test_the_watcher_recovers_a_run_whose_journal_has_a_bad_time(tmp_path, t):
    """Before: every cycle failed ("this cycle failed: OverflowError") and the run was never
    recovered."""
    run = RunDir(tmp_path / "run")
    write_journal(run.root, [line(str(T0), "segment_start"), line(t),
                             line(str(T0 + 5), "segment_end", exit_code="1")])
    client = Client()
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig())
    from datetime import datetime, timezone
    ended = Job(job_id="7", name="train", state=JobState.FAILED, restart_count=0, nodes=("n1",),
                node_count=1, exit_code=1, end_time=datetime.fromtimestamp(T0 + 6, tz=timezone.utc))
    w.step(ended, {}, T0 + 7)
    assert client.calls == [("requeue", "7")]
    assert not [e for e in read_events(run.events) if e.get("what") == "cycle_failed"]


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "-1", "0", "1e400"])
def test_a_slurm_timeout_that_is_not_a_usable_number_is_a_config_error(value):
    """Before: SLURMFT_SLURM_TIMEOUT=inf/nan/1e300 loaded, and every command failed with a
    traceback (OverflowError, ValueError: cannot convert float NaN to integer)."""
    with pytest.raises(ConfigError, match=r"^\[slurm\] timeout must be "):
        load_section(SlurmConfig, "slurm", environ={"SLURMFT_SLURM_TIMEOUT": value})


@pytest.mark.parametrize("text", ["timeout = inf", "timeout = nan", "timeout = 1e300", "retries = 10000000000"])
def test_a_slurm_setting_out_of_range_in_the_file_is_a_config_error(tmp_path, text):
    path = tmp_path / "slurmft.toml"
    path.write_text(f"[slurm]\n{text}\n")
    with pytest.raises(ConfigError, match=r"^\[slurm\] (timeout|retries) must be "):
        load_section(SlurmConfig, "slurm", config_file=path, environ={})


@pytest.mark.parametrize("command", [["status", "RUN"], ["watch", "123"], ["sweep", "--dry-run"]])
@pytest.mark.parametrize("value", ["inf", "nan", "1e300"])
def test_every_command_refuses_an_unusable_slurm_timeout_in_one_line(tmp_path, command, value):
    write_journal(tmp_path / "run", [line(str(T0), "segment_start")])
    argv = [sys.executable, "-m", "slurmft.cli", *[str(tmp_path / "run") if a == "RUN" else a for a in command]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    result = subprocess.run(argv, env={**env, "SLURMFT_SLURM_TIMEOUT": value}, capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "[slurm] timeout must be" in lines[0], result.stderr


@pytest.mark.parametrize("text", ["poll_s = inf", "poll_s = nan", "hang_min_s = 1e300"])
def test_any_float_setting_is_finite_and_bounded(tmp_path, text):
    path = tmp_path / "slurmft.toml"
    path.write_text(f"[watch]\n{text}\n")
    with pytest.raises(ConfigError, match=r"^\[watch\] (poll_s|hang_min_s) must be (a finite number|at most)"):
        load_section(WatchConfig, "watch", config_file=path, environ={})


# ----------------------------------------------------------------------------- slurmft interval


@pytest.mark.parametrize("args", [["--cost", "1e300", "--mtbf", "1e300"], ["--cost", "10", "--mtbf", "1e300"],
                                  ["--cost", "1e300", "--mtbf", "10"], ["--cost", "1", "--nodes", "9" * 40,
                                                                         "--node-mtbf", "5"]])
@pytest.mark.parametrize("as_json", [True, False])
def test_interval_refuses_values_too_large_to_use(args, as_json):
    """Before: OverflowError (cannot convert float infinity to integer); with --json it printed
    Infinity, which is not JSON."""
    result = cli("interval", *args, *(["--json"] if as_json else []))
    assert result.exit_code == 2, result.output
    assert "at most" in one_error_line(result, "interval")


def test_interval_json_is_valid_json_at_the_ends_of_the_ranges():
    result = cli("interval", "--cost", "1e-320", "--mtbf", "1e12", "--step-time", "1e-300", "--json")
    assert result.exit_code == 0, result.output
    data = strict_json(result.stdout)
    assert data["young_steps"] is None and data["young_s"] > 0


@pytest.mark.parametrize("t", [HUGE, "NaN", "Infinity"])
def test_interval_measures_a_run_whose_journal_has_bad_numbers(tmp_path, t):
    """Before: OverflowError out of the journal reader (and out of math.isfinite for a
    400-digit blocking_s)."""
    write_journal(tmp_path / "run", [line(str(T0), "segment_start"), line(t),
                                     line(str(T0 + 1), "checkpoint_committed", step="1", blocking_s=HUGE),
                                     line(str(T0 + 2), "checkpoint_committed", step="2", blocking_s="2")])
    result = cli("interval", "--run-dir", tmp_path / "run", "--mtbf", "3600", "--json")
    assert result.exit_code == 0, result.output
    assert strict_json(result.stdout)["cost_s"] == 2.0


# ----------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("created_at,error", [(HUGE, "must be a unix time"), ("1e300", "must be a unix time"),
                                              ("NaN", "NaN is not a JSON number"),
                                              ("Infinity", "Infinity is not a JSON number")])
def test_ckpt_over_a_manifest_whose_time_is_no_time(tmp_path, created_at, error):
    """Before: OverflowError out of `ckpt ls`/`inspect` (float() of 400 digits; time.localtime
    of 1e300), and `ckpt ls --json` printed NaN, which is not JSON."""
    ckpt = RunDir(tmp_path / "run").checkpoint(3)
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(
        '{"format_version": 1, "step": 3, "world_size": 1, "torch_version": "2", "job_id": "7", '
        f'"restart_count": 0, "created_at": {created_at}, "hash_algo": "xxh3_128", "files": [], "extra": {{}}}}')
    listed = cli("ckpt", "ls", tmp_path / "run", "--json")
    assert listed.exit_code == 0, listed.output
    entry = strict_json(listed.stdout)["checkpoints"][0]
    assert entry["created_at"] is None and error in entry["error"]
    inspected = cli("ckpt", "inspect", tmp_path / "run", "3")
    assert inspected.exit_code == 2 and error in one_error_line(inspected, "ckpt")


# ----------------------------------------------------------------------------- the watcher's lease


@pytest.mark.parametrize("pid", [2**40, 10**30, HUGE])
def test_a_lease_naming_a_pid_no_process_can_have_is_no_claim(tmp_path, pid):
    """Before: os.kill(2**40, 0) raised OverflowError out of the lock: the watcher could not start."""
    import socket
    import time

    from slurmft.watch.lock import RunLock

    run = RunDir(tmp_path / "run")
    run.watch_state.parent.mkdir(parents=True)
    (run.watch_state.parent / "lease.json").write_text(
        f'{{"version": 1, "host": "{socket.gethostname()}", "pid": {pid}, "token": "x", "time": {time.time()}}}')
    lock = RunLock(run)
    lock.acquire()  # the file is no lease: replaced
    lock.release()


def test_the_watchers_ettr_gauge_reads_a_journal_with_bad_numbers(tmp_path):
    """Before: a 400-digit job_submit_time raised OverflowError out of the metrics feed, which
    runs after every cycle outside the per-run guard: the watcher itself crashed, and again after
    each restart."""
    from slurmft.watch.ettr import EttrTail

    write_journal(tmp_path, [line(str(T0), "watch_started", job_submit_time=HUGE),
                             line(str(T0), "segment_start"), line(HUGE), line(str(T0 + 1), "loss", step=HUGE),
                             line(str(T0 + 2), "loss", step="1"), line(str(T0 + 3), "loss", step="2"),
                             line(str(T0 + 4), "segment_end", exit_code=HUGE)])
    ettr = EttrTail(tmp_path / "events.jsonl").poll().ettr(T0 + 10)
    assert ettr is not None and 0 < ettr <= 1
