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
