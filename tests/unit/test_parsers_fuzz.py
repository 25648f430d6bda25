"""Property tests (hypothesis) of every parser of user-written data: the manifest, a journal line
and the journal file, step directory names, ``slurmft.toml`` and its environment overrides, the
``.metadata`` opcode scan, heartbeat files (as the watcher reads them), and Slurm's own output
(real captures with any value replaced, and any bytes). The property: any input gives a value or the parser's own documented
error, never another exception; what the writer writes, the reader reads back.

Example counts are kept modest so the suite stays fast.
"""

from __future__ import annotations

import json
import pickle
import string

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slurmft.config import ConfigError, load_section
from slurmft.journal import encode_event, parse_line, read_events, segment_outcome
from slurmft.rundir import parse_step_dirname, step_dirname
from slurmft.sweep.config import SweepConfig
from slurmft.checkpoint.config import CheckpointConfig
from slurmft.checkpoint.manifest import (MANIFEST_NAME, FileEntry, Manifest, ManifestError, build_manifest,
                                    read_manifest, write_manifest)
from slurmft.checkpoint.pickle_scan import metadata_pickle_problem

pytestmark = pytest.mark.timeout(120)
FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
hostile_json_text = st.one_of(
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
    json_values.map(json.dumps),
    st.integers(min_value=1, max_value=3000).map(lambda n: "[" * n + "]" * n),
    st.integers(min_value=4301, max_value=9000).map(lambda n: '{"v":1,"t":' + "9" * n + ',"kind":"k"}'),
)


# ----------------------------------------------------------------------------- manifest


@FEW
@given(data=json_values)
def test_any_json_is_a_manifest_or_a_manifest_error(data):
    try:
        assert isinstance(Manifest.from_json(data), Manifest)
    except ManifestError:
        pass


@FEW
@given(text=hostile_json_text)
def test_any_manifest_bytes_read_as_a_manifest_or_a_manifest_error(tmp_path_factory, text):
    ckpt = tmp_path_factory.mktemp("ckpt")
    (ckpt / MANIFEST_NAME).write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        read_manifest(ckpt)
    except ManifestError as exc:
        assert str(ckpt) in str(exc)  # the message names the file


entry_paths = st.lists(st.text(string.ascii_letters + string.digits + "._-", min_size=1, max_size=12)
                       .filter(lambda p: p not in (".", "..")), min_size=1, max_size=3).map("/".join)


@FEW
@given(entries=st.lists(st.builds(FileEntry, entry_paths, st.integers(0, 2**63 - 1),  # an off_t
                                  st.text("0123456789abcdef", min_size=32, max_size=32)),
                        max_size=5, unique_by=lambda e: e.path),
       step=st.integers(0, 10**12), world=st.integers(1, 10**5))
def test_a_written_manifest_reads_back_equal(tmp_path_factory, entries, step, world):
    ckpt = tmp_path_factory.mktemp("ckpt")
    manifest = build_manifest(step, world, "2.13.0", entries, job_id="1", restart_count=0)
    write_manifest(ckpt, manifest)
    assert read_manifest(ckpt) == manifest


# ----------------------------------------------------------------------------- journal


@FEW
@given(line=hostile_json_text)
def test_any_journal_line_is_an_event_or_none(line):
    event = parse_line(line)
    assert event is None or isinstance(event.kind, str)


@FEW
@given(fields=st.dictionaries(st.text(string.ascii_lowercase, min_size=1, max_size=8)
                              .filter(lambda k: k not in ("v", "t", "kind")), json_values, max_size=4),
       kind=st.from_regex(r"\A[a-z][a-z0-9_.]{0,20}\Z"))
def test_an_encoded_event_parses_back(fields, kind):
    try:
        line = encode_event(kind, fields, now=12.5).decode()
    except ValueError:  # a float that JSON cannot hold: refused at write time
        return
    event = parse_line(line)
    assert event is not None and event.kind == kind and event.time == 12.5
    assert dict(event.fields) == {k: v for k, v in json.loads(line).items() if k not in ("v", "t", "kind")}


@FEW
@given(garbage=st.lists(hostile_json_text.map(lambda t: t.replace("\n", " ").replace("\r", " ")), max_size=5))
def test_a_recorded_exit_code_is_found_after_any_garbage(tmp_path_factory, garbage):
    path = tmp_path_factory.mktemp("run") / "events.jsonl"
    end = encode_event("segment_end", {"job_id": "7", "restart_count": 0, "exit_code": 85}, now=1.0)
    path.write_bytes("\n".join(garbage).encode("utf-8", "surrogateescape") + b"\n" + end)
    event = segment_outcome(read_events(path), "7", 0)
    assert event is not None and event.get("exit_code") == 85


# ----------------------------------------------------------------------------- step names


@FEW
@given(name=st.one_of(st.text(max_size=30), st.text(max_size=25).map(lambda t: "step_" + t),
                      st.integers(0, 10**15).map(lambda n: f"step_{n}")))
def test_a_step_name_is_canonical_or_none(name):
    step = parse_step_dirname(name)
    assert step is None or step_dirname(step) == name


@FEW
@given(step=st.integers(0, 10**18))
def test_step_names_round_trip(step):
    assert parse_step_dirname(step_dirname(step)) == step


# ----------------------------------------------------------------------------- slurmft.toml


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                      st.sampled_from(["[sweep]\nstate_dir = ''\n", "[checkpoint]\nkeep_last = 1e400\n",
                                       "[checkpoint]\nkeep_last = " + "9" * 5000 + "\n",
                                       "[sweep]\n" + "a = [" * 200 + "]" * 200 + "\n"])),
       raw=st.binary(max_size=40))
def test_any_config_file_is_a_config_or_a_config_error(tmp_path_factory, text, raw):
    path = tmp_path_factory.mktemp("cfg") / "slurmft.toml"
    path.write_bytes(text.encode("utf-8", "surrogateescape") if raw[:1] != b"\xff" else raw)
    for cls, section in ((SweepConfig, "sweep"), (CheckpointConfig, "checkpoint")):
        try:
            load_section(cls, section, config_file=path, environ={})
        except ConfigError:
            pass


@FEW
@given(value=st.text(max_size=30), field=st.sampled_from(["KEEP_LAST", "KEEP_EVERY", "MILESTONES", "INTERVAL"]))
def test_any_environment_value_is_a_setting_or_a_config_error(value, field):
    try:
        load_section(CheckpointConfig, "checkpoint", config_file=None,
                     environ={f"SLURMFT_CHECKPOINT_{field}": value.replace("\0", "")})
    except ConfigError:
        pass


# ----------------------------------------------------------------------------- .metadata scan


@FEW
@given(data=st.binary(max_size=400))
def test_any_metadata_bytes_give_a_verdict(data):
    verdict = metadata_pickle_problem(data, "x/.metadata")
    assert verdict is None or verdict.startswith("x/.metadata: ")


@FEW
@given(value=json_values, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_pickles_of_plain_data_name_no_global(value, protocol):
    assert metadata_pickle_problem(pickle.dumps(value, protocol=protocol), "m") is None


@FEW
@given(target=st.sampled_from([("os", "system"), ("builtins", "eval"), ("subprocess", "call"),
                               ("shutil", "rmtree"), ("pathlib", "Path")]),
       protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_a_pickle_naming_another_global_is_refused(target, protocol):
    import importlib

    module = importlib.import_module(target[0])
    data = pickle.dumps(getattr(module, target[1]), protocol=protocol)
    problem = metadata_pickle_problem(data, "m")
    assert problem is not None and "not a DCP metadata type" in problem


# ----------------------------------------------------------------------------- heartbeat


@FEW
@given(text=hostile_json_text, name=st.sampled_from(["n1", "n2", "odd name", ".hidden"]))
def test_any_heartbeat_file_is_a_beat_or_ignored(tmp_path_factory, text, name):
    from slurmft.rundir import RunDir
    from slurmft.watch.runview import Beat, read_heartbeats

    run = RunDir(tmp_path_factory.mktemp("run"))
    run.heartbeat_dir.mkdir()
    (run.heartbeat_dir / f"{name}.json").write_text(text, encoding="latin-1")
    beats = read_heartbeats(run)
    assert isinstance(beats, dict) and all(isinstance(b, Beat) and b.node == n for n, b in beats.items())


@FEW
@given(step=st.integers(min_value=0, max_value=10**12),
       interval=st.floats(min_value=0.5, max_value=3600, allow_nan=False),
       restart=st.integers(min_value=0, max_value=10**6))
def test_a_written_heartbeat_reads_back(tmp_path_factory, step, interval, restart):
    from slurmft.rundir import RunDir
    from slurmft.train.heartbeat import Heartbeat
    from slurmft.watch.runview import read_heartbeats

    run = RunDir(tmp_path_factory.mktemp("run"))
    Heartbeat(run, "n1", job_id="9_1", restart_count=restart, interval_s=interval).beat(step, force=True, busy_s=0.5)
    beat = read_heartbeats(run)["n1"]
    assert (beat.step, beat.restart_count, beat.job_id, beat.interval_s, beat.busy_s) == (
        step, restart, "9_1", interval, 0.5)
    assert beat.step_s is not None and beat.step_s >= 0 and beat.phase is None


# ----------------------------------------------------------------------------- Slurm output

SLURM_CAPTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


def _mutate(doc, path, value):
    """``doc`` with one value replaced: ``path`` walks keys (a key the object lacks picks one of
    its keys) and list indices (modulo the length); the last step's slot gets ``value``."""
    def slot(node, key):
        pick = key if isinstance(key, int) else sum(map(ord, key))
        if isinstance(node, list):
            return pick % len(node)
        return key if key in node else sorted(node)[pick % len(node)]

    node = doc
    for i, key in enumerate(path):
        if not isinstance(node, (dict, list)) or not node:
            break
        k = slot(node, key)
        if i == len(path) - 1 or not isinstance(node[k], (dict, list)):
            node[k] = value
            break
        node = node[k]
    return doc


@settings(max_examples=80, deadline=None)
# Found by this test in a fresh-clone run (2026-11-27): a sacct job's comment that is neither the
# 23.02+ object nor a string raised TypeError instead of a SlurmError naming it.
@example(capture=("2411/sacct_history.json", "sacct"), path=["jobs", "jobs", "comment"], value=True)
@given(capture=st.sampled_from([("2205/squeue_running_failed_completed.json", "squeue"),
                                ("2205/squeue_running_time_limit.json", "squeue"),
                                ("2411/squeue_running_failed.json", "squeue"),
                                ("2605/squeue_running_failed.json", "squeue"),
                                ("2411/sacct_history.json", "sacct"),
                                ("2205/sinfo_drain_down.json", "nodes"),
                                ("2605/scontrol_nodes_drain.json", "nodes")]),
       path=st.lists(st.sampled_from(["jobs", "nodes", "job_state", "state", "time", "exit_code",
                                      "nodes", "time_limit", "end_time", "restart_cnt", "comment",
                                      "array_job_id", "array_task_id", "number", "current", 0, 1]),
                     min_size=1, max_size=5),
       value=json_values)
def test_any_change_to_real_slurm_output_parses_or_is_a_slurm_error(capture, path, value):
    # Real captures (tests/fixtures/slurm/README.md) with one value anywhere replaced by any JSON:
    # a list of jobs/nodes or the client's own SlurmError naming the field, never another exception.
    from slurmft.slurm.client import SlurmError
    from slurmft.slurm.parse_jobs import parse_sacct, parse_squeue
    from slurmft.slurm.parse_nodes import parse_nodes

    name, kind = capture
    doc = _mutate(json.loads((SLURM_CAPTURES / name).read_text()), path, value)
    parse = {"squeue": parse_squeue, "sacct": parse_sacct,
             "nodes": lambda text: parse_nodes(text, "sinfo --json")}[kind]
    try:
        parse(json.dumps(doc))
    except SlurmError:
        pass


@FEW
@given(text=hostile_json_text)
def test_any_bytes_as_slurm_output_parse_or_are_a_slurm_error(text):
    from slurmft.slurm.client import SlurmError
    from slurmft.slurm.parse_jobs import parse_sacct, parse_sacct_text, parse_squeue
    from slurmft.slurm.parse_nodes import parse_nodes

    for parse in (parse_squeue, parse_sacct, parse_sacct_text, lambda t: parse_nodes(t, "sinfo --json")):
        try:
            parse(text)
        except SlurmError:
            pass


def test_heartbeat_numbers_too_big_for_a_float_are_ignored(tmp_path):
    # json.loads reads a 400-digit int; float() of it raised OverflowError in the watcher's reader.
    from slurmft.rundir import RunDir
    from slurmft.watch.runview import read_heartbeats

    run = RunDir(tmp_path / "run")
    run.heartbeat_dir.mkdir(parents=True)
    big = "9" * 400
    (run.heartbeat_dir / "n1.json").write_text('{"node": "n1", "time": %s}' % big)
    (run.heartbeat_dir / "n2.json").write_text(
        '{"node": "n2", "time": 5.0, "recent_step_s": %s, "every": %s}' % (big, big))
    beats = read_heartbeats(run)
    assert "n1" not in beats   # no usable time: not a beat
    assert beats["n2"].step_s is None and beats["n2"].every is None
