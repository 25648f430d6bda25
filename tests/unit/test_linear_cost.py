"""Every reader of a user's file runs in time linear in its size, up to the file's cap (issue 26
item 5: ``slurmft ckpt ls --json`` over a 869 KB ``ckpt_tiers.json`` ran for 461 s as root).

Each test writes an input at (just under) the reader's cap, shaped to be the reader's worst case
(as many entries as fit), and compares the reader there with the same reader over 1/16 of it
(``linear_cost.assert_linear``: a ratio measured in the test, never a wall-clock budget).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from linear_cost import assert_linear
from slurmft.cli import app
from slurmft.checkpoint.tiers import MAX_TIERS_BYTES

pytestmark = pytest.mark.timeout(300)


def largest_under(cap: int, make) -> bytes:
    """``make(n)`` for the largest n whose bytes fit in ``cap`` (``make`` grows with n)."""
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(make(mid)) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return make(lo)


def compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _dir(tmp_path: Path, d: int) -> Path:
    path = tmp_path / f"1-of-{d}"
    path.mkdir()
    return path


@pytest.mark.parametrize("nodes", [1, 16])
@pytest.mark.parametrize("as_json", [True, False])
def test_ckpt_ls_over_a_tier_record_at_its_cap(tmp_path, nodes, as_json):
    """``ckpt_tiers.json`` at 1 MiB naming ~165,000 steps (one node) or ~12,000 on each of 16."""
    def reader_for(d):
        run = _dir(tmp_path, d)
        (run / "checkpoints").mkdir()
        raw = largest_under(MAX_TIERS_BYTES // d, lambda n: compact({
            "format": 1, "updated": 0, "nodes": {f"n{i:02d}": list(range(n)) for i in range(nodes)}}))
        (run / "ckpt_tiers.json").write_bytes(raw)
        args = ["ckpt", "ls", *(["--json"] if as_json else []), str(run)]

        def read():
            result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
            assert result.exit_code == 0, result.output
        return read

    took, base = assert_linear(f"ckpt ls{' --json' if as_json else ''}, {nodes} node(s)", reader_for)
    print(f"ckpt ls json={as_json} nodes={nodes}: {took:.3f} s at the cap, {base:.3f} s at 1/16")


def test_manifest_at_its_cap(tmp_path):
    """``manifest.json`` at 64 MiB (~400,000 file entries), read by every ``ckpt`` command as root."""
    from slurmft.checkpoint.manifest import MAX_MANIFEST_BYTES, FileEntry, build_manifest, read_manifest, write_manifest

    per_entry = 140  # bytes of one indented entry, with room to spare

    def reader_for(d):
        ckpt = _dir(tmp_path, d)
        n = MAX_MANIFEST_BYTES // d // per_entry
        files = [FileEntry(f"__{i % 8}_0.distcp/{i:09d}", i, f"xxh3_128:{i:032x}") for i in range(n)]
        write_manifest(ckpt, build_manifest(7, 8, "2.5.0", files))
        assert (ckpt / "manifest.json").stat().st_size <= MAX_MANIFEST_BYTES // d
        return lambda: read_manifest(ckpt)

    took, base = assert_linear("read_manifest", reader_for)
    print(f"read_manifest: {took:.3f} s at the cap, {base:.3f} s at 1/16")


def test_done_marker_at_its_cap(tmp_path):
    """``DONE`` at 64 KiB: one object with as many fields as fit (the watcher reads it each cycle)."""
    from slurmft.rundir import MAX_DONE_BYTES, RunDir, read_done

    def reader_for(d):
        run = _dir(tmp_path, d)
        raw = largest_under(MAX_DONE_BYTES // d, lambda n: compact(
            {"job_id": "1", "step": 5, "total_steps": 9, **{f"k{i}": i for i in range(n)}}))
        (run / "DONE").write_bytes(raw)
        return lambda: read_done(RunDir(run))

    assert_linear("read_done", reader_for)


def test_sweep_state_at_its_cap(tmp_path):
    """Root's sweep state at 16 MiB: NVLink counters for as many links as fit, checked field by field."""
    from slurmft.health.state import MAX_STATE_BYTES, HealthState

    def reader_for(d):
        state = _dir(tmp_path, d) / "health-n1.json"
        links = MAX_STATE_BYTES // d // (8 * 40)  # ~35 bytes a link: '"1234567":{"crc":1234567,"replay":1},'
        raw = compact({"version": 1, "data": {"nvlink": {
            f"0000:{g:02x}:00.0": {str(link): {"crc": link, "replay": 1} for link in range(links)}
            for g in range(8)}}})
        assert MAX_STATE_BYTES // d // 2 < len(raw) <= MAX_STATE_BYTES // d
        state.write_bytes(raw)

        def read():
            assert not HealthState.load(state).unreadable
        return read

    assert_linear("HealthState.load", reader_for)


def test_watch_state_at_its_cap(tmp_path):
    """``watch/state.json`` at 64 KiB: as many node fault counts and exclusions as fit."""
    from slurmft.rundir import RunDir
    from slurmft.watch.runview import MAX_SMALL_FILE
    from slurmft.watch.state import RunState, load_state

    def make(n):
        state = RunState(job_id="1")
        state.node_faults = {f"n{i:05d}": 1 for i in range(n)}
        state.excluded = [f"n{i:05d}" for i in range(n)]
        return compact(state.to_json())

    def reader_for(d):
        run = _dir(tmp_path, d)
        (run / "watch").mkdir()
        (run / "watch" / "state.json").write_bytes(largest_under(MAX_SMALL_FILE // d, make))
        return lambda: load_state(RunDir(run), "1")

    assert_linear("load_state", reader_for)


def test_heartbeat_at_its_cap(tmp_path):
    """A node's heartbeat file at 64 KiB: a beat with as many extra fields as fit."""
    import time

    from slurmft.rundir import RunDir
    from slurmft.watch.runview import MAX_SMALL_FILE, read_heartbeats

    # One time for every size tried: a float's repr varies in length (``largest_under`` measured
    # one and wrote another, a byte over the cap: the reader passed it over, s9a's fresh run).
    now = time.time()

    def reader_for(d):
        run = _dir(tmp_path, d)
        (run / "heartbeat").mkdir()
        raw = largest_under(MAX_SMALL_FILE // d, lambda n: compact(
            {"node": "n01", "time": now, "step": 5, "restart_count": 0, "job_id": "1",
             **{f"k{i}": i for i in range(n)}}))
        (run / "heartbeat" / "n01.json").write_bytes(raw)

        def read():
            beats = read_heartbeats(RunDir(run))
            assert beats is not None and "n01" in beats
        return read

    assert_linear("read_heartbeats", reader_for)


def test_submit_record_at_its_cap(tmp_path):
    """``watch/submit.json`` at 64 KiB: a submit line of as many ``-x <node>`` options as fit,
    read, split and merged into a resubmission's arguments."""
    from slurmft.rundir import RunDir
    from slurmft.watch.resubmit import SubmitRecord, load_record, resubmit_argv
    from slurmft.watch.runview import MAX_SMALL_FILE

    def make(n):
        tokens = ["sbatch", *[t for i in range(n) for t in ("-x", f"n{i:05d}")], "job.sh", "--steps", "9"]
        return compact({"job_id": "7", "submit_line": " ".join(tokens), "work_dir": "/w",
                        "script_index": 1 + 2 * n})

    def reader_for(d):
        run = _dir(tmp_path, d)
        path, _ = SubmitRecord.paths(RunDir(run))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(largest_under(MAX_SMALL_FILE // d, make))

        def read():
            record = load_record(RunDir(run))
            assert record is not None
            argv = resubmit_argv(record, run / "script", run, ["n99999"])
            assert argv[-3:] == [str(run / "script"), "--steps", "9"]
        return read

    assert_linear("load_record + resubmit_argv", reader_for)


def test_status_over_a_journal_of_many_short_segments(tmp_path):
    """``slurmft status`` (root, over a user's journal) made one pass over the whole journal per
    segment: a 2 MiB journal of 4,000 short segments took 36 s, 8x the time of half of it. The
    input is the report's worst case, as many segments as fit (each a start, two losses, a
    commit and an end); the reader is the whole report. Measured at 4 MiB, not at the reader's
    cap (``MAX_JOURNAL_BYTES``, a full training run's journal): the ratio to 1/16 is what tells a
    linear report from a quadratic one, at any size."""
    from slurmft.journal import encode_event
    from slurmft.status.report import build_report, read_journal

    size = 4 << 20
    t0 = 1.7e9

    def segments(n: int) -> bytes:
        out, t = [], t0
        for r in range(n):
            key = {"job_id": "7", "restart_count": r}
            out.append(encode_event("segment_start", {**key, "rank": 0, "world_size": 2,
                                                      "restored_step": 2 * r}, now=t))
            out += [encode_event("loss", {**key, "step": 2 * r + s, "loss": 1.0}, now=t + s)
                    for s in (1, 2)]
            out.append(encode_event("checkpoint_committed", {**key, "step": 2 * r + 2}, now=t + 3))
            out.append(encode_event("segment_end", {**key, "exit_code": 85}, now=t + 4))
            t += 5
        return b"".join(out)

    def reader_for(d):
        path = _dir(tmp_path, d) / "events.jsonl"
        per_segment = len(segments(1))
        path.write_bytes(segments(size // d // per_segment))

        def read():
            report = build_report(read_journal(path), None, now=t0 + 1e9)
            assert report.faults and report.segments
        return read

    took, base = assert_linear("slurmft status over many segments", reader_for)
    print(f"status: {took:.3f} s at 4 MiB, {base:.3f} s at 1/16")
