"""``allocation.json``, the in-allocation launcher's record (issue 27's contract): what the
launcher writes every reader accepts, and a file in the user's run dir that is wrong in any field
is refused with one line naming that field, never guessed at."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurmft import allocation
from slurmft.allocation import Allocation, AllocationError, Fence
from slurmft.rundir import RunDir

GOOD = {"version": 1, "job_id": "12_3", "generation": 2, "active": ["n1", "n2", "n4"],
        "spares": ["n5"], "fenced": [{"node": "n3", "cause": "node_death", "time": 1_800_000_000.5,
                                      "evidence": ["n3 silent 10.2 s", "step 4 ended: exit 9"]}],
        "min_nodes": 2}


@pytest.fixture
def run(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    return rd


def test_what_the_launcher_writes_is_what_every_reader_reads(run):
    record = Allocation(job_id="12_3", generation=2, active=("n1", "n2", "n4"), spares=("n5",),
                        fenced=(Fence("n3", "node_death", 1_800_000_000.5,
                                      ("n3 silent 10.2 s", "step 4 ended: exit 9")),),
                        min_nodes=2)
    assert allocation.read(run) is None  # no file: not in in-allocation mode
    allocation.write(run, record)
    assert allocation.read(run) == record
    assert json.loads(run.allocation.read_text()) == GOOD
    assert record.fenced_nodes == ("n3",) and record.for_job({"12_3", "12"}) and not record.for_job("13")
    assert [p.name for p in run.root.iterdir()] == ["allocation.json"]  # no temp file left


def test_a_spare_job_from_outside_the_allocation_is_kept_with_its_node(run):
    record = Allocation(job_id="12", generation=1, active=("n1", "n7"), spares=(),
                        fenced=(Fence("n2", "node_death", None),),
                        spare_jobs=(allocation.SpareJob("40", "n7"), allocation.SpareJob("41")))
    allocation.write(run, record)
    back = allocation.read(run)
    assert back == record
    assert back.spare_job_of("n7") == "40" and back.spare_job_of("n1") is None
    assert back.spare_job_ids == {"40", "41"}
    assert json.loads(run.allocation.read_text())["spare_jobs"] == [
        {"job_id": "40", "node": "n7"}, {"job_id": "41", "node": ""}]


@pytest.mark.parametrize("field, value, named", [
    ("spare_jobs", {"40": "n7"}, "spare_jobs must be a list"),
    ("spare_jobs", [{"job_id": None}], "spare_jobs[0].job_id"),
    ("spare_jobs", [{"job_id": "40", "node": "../n7"}], "spare_jobs[0].node"),
    ("spare_jobs", [{"job_id": "40"}, {"job_id": "40"}], "names a job twice"),
    ("spare_jobs", [{"job_id": "40", "node": "n7"}, {"job_id": "41", "node": "n7"}], "names a node twice"),
    ("version", 2, "version 2 is newer"),
    ("version", True, "version"),
    ("job_id", None, "job_id"),
    ("generation", -1, "generation"),
    ("generation", 1e400, "generation"),
    ("active", "n1,n2", "active must be a list"),
    ("active", ["n1", "../etc"], "active[1]"),
    ("active", ["n1", "n1"], "active names a node twice"),
    ("spares", ["n1"], "both active and a spare"),
    ("fenced", [{"node": "n3", "time": "soon"}], "fenced[0].time"),
    ("fenced", [{"node": "n 3"}], "fenced[0].node"),
    ("fenced", [{"node": "n3", "evidence": [7]}], "fenced[0].evidence[0]"),
    ("min_nodes", 0, "min_nodes"),
])
def test_a_bad_field_is_named(field, value, named):
    with pytest.raises(AllocationError, match="allocation.json: .*" + named.replace("[", r"\[").replace("]", r"\]")):
        allocation.parse({**GOOD, field: value})


def test_a_file_that_is_no_record_is_refused_not_guessed(run):
    target = run.allocation
    target.write_text("{not json")
    with pytest.raises(AllocationError, match="not JSON"):
        allocation.read(run)
    target.unlink()
    (run.root / "elsewhere.json").write_text(json.dumps(GOOD))
    os.symlink(run.root / "elsewhere.json", target)
    with pytest.raises(AllocationError, match="cannot be read"):
        allocation.read(run)
    target.unlink()
    target.write_text(json.dumps({**GOOD, "evidence": "x" * (allocation.MAX_BYTES + 1)}))
    with pytest.raises(AllocationError, match="cannot be read"):
        allocation.read(run)
    target.unlink()
    os.mkfifo(target)  # a FIFO never blocks the reader
    with pytest.raises(AllocationError, match="cannot be read"):
        allocation.read(run)


def test_the_writer_refuses_what_readers_would():
    with pytest.raises(AllocationError, match="both active and a spare"):
        allocation.write(RunDir(Path("/nonexistent")),
                         Allocation(job_id="1", generation=0, active=("n1",), spares=("n1",)))
