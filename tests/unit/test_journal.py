"""events.jsonl: one O_APPEND line per event, versioned, tolerant reader, template CLI."""

import json
import multiprocessing

import pytest

from slurmft import exitcodes, journal
from slurmft.journal import Journal, JournalError, append_event, read_events
from slurmft.rundir import RunDir


def test_append_and_read_round_trip(tmp_path):
    j = Journal(RunDir(tmp_path), job_id="42", restart_count=1)
    j.append(journal.SEGMENT_START, world_size=4, nodes=["n1", "n2"], restored_step=None)
    j.append(journal.LOSS, step=3, loss=1.25)
    events = j.read()
    assert [e.kind for e in events] == ["segment_start", "loss"]
    assert events[0].get("nodes") == ["n1", "n2"] and events[0].get("job_id") == "42"
    assert [e.kind for e in j.read(kinds=["loss"])] == ["loss"]
    line = (tmp_path / "events.jsonl").read_text().splitlines()[1]
    assert json.loads(line)["v"] == journal.JOURNAL_VERSION


@pytest.mark.parametrize("kind, fields, needle", [
    ("Bad Kind", {}, "must match"),
    ("loss", {"kind": "x"}, "reserved"),
    ("loss", {"loss": float("nan")}, "not JSON-serialisable"),
    ("loss", {"obj": object()}, "not JSON-serialisable"),
])
def test_bad_events_are_refused_before_writing(tmp_path, kind, fields, needle):
    with pytest.raises(JournalError, match=needle):
        append_event(tmp_path / "events.jsonl", kind, **fields)
    assert not (tmp_path / "events.jsonl").exists()


def test_reader_skips_torn_and_newer_lines(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    append_event(path, "a", x=1)
    with open(path, "a") as fh:
        fh.write('{"v": 99, "t": 1, "kind": "future"}\n{"v": 1, "t": 2, "ki')
    assert [e.kind for e in read_events(path)] == ["a"]
    assert "skipped 2 line(s)" in caplog.text
    assert read_events(tmp_path / "missing.jsonl") == []


def _writer(path, tag, n):
    for i in range(n):
        append_event(path, "w", tag=tag, i=i, pad="x" * 2000)


@pytest.mark.timeout(60)
def test_concurrent_writers_never_interleave(tmp_path):
    path = tmp_path / "events.jsonl"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, t, 100)) for t in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    events = read_events(path)
    assert len(events) == 300
    for tag in range(3):
        assert [e.get("i") for e in events if e.get("tag") == tag] == list(range(100))


def test_cli_append_and_outcome(tmp_path, capsys):
    run = RunDir(tmp_path)
    j = Journal(run, job_id="7", restart_count=2)
    j.append(journal.SEGMENT_END, exit_code=exitcodes.REQUEUE, reason="preempted")
    assert journal.main(["outcome", str(tmp_path), "7", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(exitcodes.REQUEUE)
    assert journal.main(["outcome", str(tmp_path), "7", "3"]) == 0
    assert capsys.readouterr().out == ""
    assert journal.main(["append", str(tmp_path), "template", "action=requeue", "code=85"]) == 0
    last = read_events(run.events)[-1]
    assert (last.kind, last.get("action"), last.get("code")) == ("template", "requeue", 85)
    assert journal.main(["append", str(tmp_path), "template", "novalue"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_journal_is_torch_free():
    import subprocess
    import sys
    code = "import sys, slurmft.journal, slurmft.exitcodes; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_per_step_events_are_buffered_and_durable_ones_flush_them_in_order(tmp_path, monkeypatch):
    synced = []
    real_fsync = journal.os.fsync
    monkeypatch.setattr(journal.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    j = Journal(tmp_path, job_id="7", restart_count=0, flush_every_events=1000, flush_every_s=3600)
    j.append(journal.SEGMENT_START, restored_step=None)
    assert len(synced) == 1  # durable at once
    for step in range(1, 51):
        j.append(journal.LOSS, step=step, loss=1.0 / step)
    assert len(synced) == 1 and j.pending == 50  # 50 steps: no write, no fsync
    assert [e.kind for e in read_events(tmp_path / "events.jsonl")] == ["segment_start"]
    j.append(journal.CHECKPOINT_COMMITTED, step=50)  # durable: writes the buffered lines first
    assert len(synced) == 2 and j.pending == 0
    events = read_events(tmp_path / "events.jsonl")
    assert [e.kind for e in events] == ["segment_start"] + ["loss"] * 50 + ["checkpoint_committed"]
    assert [e.get("step") for e in events[1:51]] == list(range(1, 51))
    assert all(a.time <= b.time for a, b in zip(events, events[1:]))  # stamped when appended


def test_buffered_events_are_written_every_n_events_and_every_n_seconds(tmp_path, monkeypatch):
    j = Journal(tmp_path, flush_every_events=10, flush_every_s=3600)
    for step in range(25):
        j.append(journal.LOSS, step=step)
    assert len(read_events(tmp_path / "events.jsonl")) == 20 and j.pending == 5
    clock = [1000.0]
    monkeypatch.setattr(journal.time, "monotonic", lambda: clock[0])
    k = Journal(tmp_path / "k", flush_every_events=1000, flush_every_s=5)
    k.append(journal.LOSS, step=1)
    clock[0] += 6  # the oldest buffered line is now older than flush_every_s
    k.append(journal.LOSS, step=2)
    assert [e.get("step") for e in read_events(tmp_path / "k" / "events.jsonl")] == [1, 2]


def test_buffered_events_are_flushed_at_interpreter_exit(tmp_path):
    import subprocess
    import sys
    code = ("import sys; from slurmft import journal; "
            "j = journal.Journal(sys.argv[1], flush_every_events=1000); "
            "[j.append(journal.LOSS, step=s) for s in range(3)]")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    assert [e.get("step") for e in read_events(tmp_path / "events.jsonl")] == [0, 1, 2]


def test_journal_config_layers_and_errors(tmp_path, monkeypatch):
    from slurmft.config import ConfigError
    from slurmft.journal import JournalConfig

    assert JournalConfig.load(environ={}) == JournalConfig(100, 10.0)
    assert JournalConfig.load(environ={"SLURMFT_JOURNAL_FLUSH_EVERY_EVENTS": "1"}).flush_every_events == 1
    toml = tmp_path / "slurmft.toml"
    toml.write_text("[journal]\nflush_every_s = 0\n")
    with pytest.raises(ConfigError, match=r"\[journal\] flush_every_s must be > 0"):
        JournalConfig.load(toml, environ={})
    with pytest.raises(ValueError, match="flush_every_events must be >= 1"):
        Journal(tmp_path, flush_every_events=0)


def test_segment_journal_is_durable_per_event_when_configured(tmp_path, monkeypatch):
    from slurmft.train.runtime import JobEnv, Segment

    monkeypatch.setenv("SLURMFT_JOURNAL_FLUSH_EVERY_EVENTS", "1")
    segment = Segment(JobEnv.from_environ({}), RunDir(tmp_path))
    segment.record(journal.LOSS, step=1, loss=2.0)
    assert [e.get("step") for e in read_events(tmp_path / "events.jsonl")] == [1]


def test_a_journal_that_buffers_nothing_registers_nothing_at_exit(tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr(journal.atexit, "register", lambda *a: registered.append(a))
    for _ in range(3):  # the watcher makes one Journal per event it writes
        Journal(tmp_path).append(journal.SEGMENT_START)
    assert registered == []
    j = Journal(tmp_path)
    j.append(journal.LOSS, step=1)
    j.append(journal.LOSS, step=2)
    assert len(registered) == 1
