"""``slurmft.watch.metrics``: what the loop records comes out right in the text format, over HTTP
and in an atomically written textfile; the watcher's real journal events map to the right
metrics (the alert rules over them: test_alert_rules.py)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurmft.journal import read_events
from slurmft.watch.metrics import MetricsError, WatchMetrics

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "journal" / "preempt_crash.events.jsonl"
NOW = 1_800_000_000.0
W = ("where", "requeue")  # the watcher's own faults and restarts


def samples(text: bytes | str) -> dict[tuple[str, tuple], float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def exercised() -> WatchMetrics:
    m = WatchMetrics(clock=lambda: NOW)
    m.watching("42")
    m.record_fault("42", "node_down", 25.0)
    m.record_recovery("42", "node_down", 31.5)
    m.record_fault("42", "hang", None)
    m.set_ettr("42", 0.93)
    m.set_checkpoint("42", 1200, 90.0)
    m.cycle(0.04, observed=True)
    m.record_gave_up("7", "crash")
    return m


def test_what_the_loop_records():
    got = samples(exercised().text())
    j = ("slurm_job", "42")
    assert got[("slurmft_watch_faults_total", (("cause", "node_down"), j, W))] == 1
    assert got[("slurmft_watch_faults_total", (("cause", "hang"), j, W))] == 1
    assert got[("slurmft_watch_restarts_total", (("cause", "node_down"), j, W))] == 1
    assert got[("slurmft_watch_detect_seconds_sum", (("cause", "node_down"), j, W))] == 25.0
    assert got[("slurmft_watch_detect_seconds_bucket", (("cause", "node_down"), ("le", "20.0"), j, W))] == 0
    assert got[("slurmft_watch_detect_seconds_bucket", (("cause", "node_down"), ("le", "30.0"), j, W))] == 1
    assert ("slurmft_watch_detect_seconds_count", (("cause", "hang"), j, W)) not in got  # no time known
    assert got[("slurmft_watch_recover_seconds_sum", (("cause", "node_down"), j, W))] == 31.5
    assert got[("slurmft_watch_ettr", (j,))] == 0.93
    assert got[("slurmft_watch_last_checkpoint_step", (j,))] == 1200
    assert got[("slurmft_watch_last_checkpoint_age_seconds", (j,))] == 90
    assert got[("slurmft_watch_last_checkpoint_timestamp_seconds", (j,))] == NOW - 90
    assert got[("slurmft_watch_run_active", (j,))] == 1
    assert got[("slurmft_watch_gave_up", (("slurm_job", "7"),))] == 1
    assert got[("slurmft_watch_run_active", (("slurm_job", "7"),))] == 0
    assert got[("slurmft_watch_controller_reachable", ())] == 1
    assert got[("slurmft_watch_last_successful_poll_timestamp_seconds", ())] == NOW
    assert got[("slurmft_watch_cycle_duration_seconds_count", ())] == 1


def test_an_unobserved_cycle_marks_the_controller_unreachable_and_keeps_the_last_poll_time():
    times = iter([100.0, 200.0])
    m = WatchMetrics(clock=lambda: next(times))
    m.cycle(0.1, observed=True)
    m.cycle(20.0, observed=False)
    got = samples(m.text())
    assert got[("slurmft_watch_controller_reachable", ())] == 0
    assert got[("slurmft_watch_last_successful_poll_timestamp_seconds", ())] == 100.0
    assert got[("slurmft_watch_cycle_duration_seconds_count", ())] == 2


def test_the_watchers_journal_events_of_a_real_run():
    """The captured run: a preemption the watcher expedited, then a crash it recovered."""
    m = WatchMetrics(clock=lambda: NOW)
    for e in read_events(FIXTURE):  # as RunWatch hands them to its listeners
        m.on_event(e.kind, {"time": e.time, **e.fields})
    got = samples(m.text())
    j = ("slurm_job", "1")
    assert got[("slurmft_watch_faults_total", (("cause", "crash"), j, W))] == 1
    assert got[("slurmft_watch_faults_total", (("cause", "preempted"), j, W))] == 1
    assert got[("slurmft_watch_restarts_total", (("cause", "crash"), j, W))] == 1
    crash_fault = next(e for e in read_events(FIXTURE) if e.get("cause") == "crash")
    running = next(e for e in read_events(FIXTURE) if e.kind == "job_running" and e.get("cause") == "crash")
    assert got[("slurmft_watch_detect_seconds_sum", (("cause", "crash"), j, W))] == \
        pytest.approx(crash_fault.time - crash_fault.get("fault_time"))
    assert got[("slurmft_watch_recover_seconds_sum", (("cause", "crash"), j, W))] == \
        pytest.approx(running.get("start_time") - running.get("fault_time"))
    assert ("slurmft_watch_detect_seconds_count", (("cause", "preempted"), j, W)) not in got  # no fault_time
    assert got[("slurmft_watch_run_active", (j,))] == 0  # run_finished


def test_serve_on_a_port_and_a_port_in_use():
    m = exercised()
    port = m.serve(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            body = resp.read()
        assert samples(body)[("slurmft_watch_ettr", (("slurm_job", "42"),))] == 0.93
        with pytest.raises(MetricsError, match=f"cannot serve metrics on 127.0.0.1:{port}: "):
            WatchMetrics().serve(port)
    finally:
        m.stop()
    with pytest.raises(MetricsError, match="metrics port must be 0..65535, got 70000"):
        m.serve(70000)


def test_textfile_is_written_atomically(tmp_path):
    path = tmp_path / "textfile" / "slurmft_watch.prom"
    m = exercised()
    m.write_textfile(path)
    assert samples(path.read_text()) == samples(m.text())
    assert sorted(p.name for p in path.parent.iterdir()) == ["slurmft_watch.prom"]  # no temp left
    with pytest.raises(MetricsError, match="must end in .prom"):
        m.write_textfile(tmp_path / "watch.txt")
    (tmp_path / "file").write_text("")
    with pytest.raises(MetricsError, match=f"cannot write metrics to {tmp_path}/file/w.prom"):
        m.write_textfile(tmp_path / "file" / "w.prom")
