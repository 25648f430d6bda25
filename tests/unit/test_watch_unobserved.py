"""A cycle in which the run dir itself could not be read (its ``stat`` failed: an NFS server that
answers ESTALE or EIO for a moment) is "could not observe": the watcher decides nothing on an
absent DONE it could not look for. Before, it read as "not DONE": a forgotten job whose run had
finished was resubmitted (or marked lost), a job that ended failed after its DONE was requeued.
(Unit: a transient ESTALE has no real counterpart on the local disk; ``os.stat`` of the run dir
alone is made to fail.)"""

from __future__ import annotations

import errno
import json
import os

from slurmft.journal import read_events
from slurmft.slurm.client import JobState
from slurmft.watch import follow, runview
from slurmft.watch.config import WatchConfig
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import FINISHED, WATCHING, RunState

from test_watch_resubmit import SCRIPT, ResubmitClient, site  # noqa: F401  (the fixture)
from test_watch_runwatch import NODES, T0, job
from slurmft.watch import resubmit


def unreadable_root(monkeypatch, root):
    """The watcher's read of the run dir (``runview``'s ``os``) gets ESTALE for the root alone;
    every other module (the journal, the state) still works."""

    class StaleRoot:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def stat(path, *args, **kwargs):
            if os.fspath(path) == os.fspath(root):
                raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), os.fspath(path))
            return os.stat(path, *args, **kwargs)

    monkeypatch.setattr(runview, "os", StaleRoot())


def test_a_forgotten_finished_run_is_not_resubmitted_while_its_run_dir_cannot_be_read(
        site, monkeypatch):  # noqa: F811
    run, line, work = site
    client = ResubmitClient(line)
    resubmit.save_record(run, "7", line, str(work), SCRIPT)
    run.done.write_text(json.dumps({"job_id": "7"}))
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig())
    with monkeypatch.context() as m:
        unreadable_root(m, run.root)
        w.step(None, NODES, T0 + 900)  # Slurm forgot the job; DONE could not be looked for
    assert client.calls == [] and w.state.phase == WATCHING and w.job_id == "7"
    assert not [e for e in read_events(run.events) if e.kind in ("fault_detected", "job_resubmitted")]
    w.step(None, NODES, T0 + 930)  # readable again: DONE seen, the run is over
    assert client.calls == [] and w.state.phase == FINISHED


def test_a_job_that_failed_after_its_done_is_not_requeued_while_the_run_dir_cannot_be_read(
        site, monkeypatch):  # noqa: F811
    run, line, work = site
    client = ResubmitClient(line)
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig())
    w.step(job(work_dir=work), NODES, T0)
    run.done.write_text(json.dumps({"job_id": "7"}))
    ended = job(state=JobState.FAILED, exit_code=1, work_dir=work)  # a teardown error after DONE
    with monkeypatch.context() as m:
        unreadable_root(m, run.root)
        w.step(ended, NODES, T0 + 60)
    assert client.calls == [] and w.state.phase == WATCHING
    w.step(ended, NODES, T0 + 90)
    assert client.calls == [] and w.state.phase == FINISHED


def test_a_done_marker_that_cannot_be_looked_for_is_unknown_not_absent(tmp_path, monkeypatch):
    from slurmft.rundir import RunDir
    from slurmft.watch.filecache import RunFilesCache

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    cache = RunFilesCache()
    real_lstat = os.lstat

    class EioDone:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def lstat(path, *args, **kwargs):
            if os.fspath(path) == os.fspath(run.done):
                raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
            return real_lstat(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(runview, "os", EioDone())
        assert runview.read_run_files(run, cache)[1] is None and not cache.observed
    assert runview.read_run_files(run, cache)[1] is None and cache.observed  # absent, and known so


def test_a_journal_that_cannot_be_read_is_not_observed_and_nothing_is_decided(tmp_path, monkeypatch):
    """The journal exists but its read fails (an NFS ESTALE): the summary is older than the run.
    A time-limit end the watcher cannot see was taken for a crash (a fault, counted toward the
    give-up rules) and requeued; now the cycle decides nothing, and the next one, with the
    journal readable, sees the planned end."""
    from slurmft import journal
    from slurmft.rundir import RunDir
    from test_watch_runwatch import RecordingClient

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    client = RecordingClient()
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig(start_now_delay_s=0))
    w.step(job(), NODES, T0)
    journal.append_event(run.events, journal.PREEMPTION, job_id="7", restart_count=0, step=10,
                         signal="USR2")
    journal.append_event(run.events, journal.TEMPLATE, job_id="7", restart_count=0,
                         action="requeue", reason="training saved and asked to be requeued")
    journal.append_event(run.events, journal.SEGMENT_END, job_id="7", restart_count=0, exit_code=85)
    real_lstat = os.lstat

    class StaleJournal:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def lstat(path, *args, **kwargs):
            if os.fspath(path) == os.fspath(run.events):
                raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), os.fspath(path))
            return real_lstat(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(follow, "os", StaleJournal())
        w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 100)
    assert client.calls == [] and w.state.restarts_by_cause == {}
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 105)
    kinds = [e.kind for e in read_events(run.events)]
    assert "fault_detected" not in kinds and "planned_end" in kinds
    assert w.state.restarts_by_cause == {"preempted": 1}


def test_a_run_without_a_journal_yet_is_observed():
    tail = runview.JournalTail(__import__("pathlib").Path("/nonexistent/events.jsonl"))
    tail.poll()
    assert tail.observed
