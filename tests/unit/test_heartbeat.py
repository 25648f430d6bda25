"""Heartbeat file: written by node leaders every k steps, atomically, with the recent step time."""

import pytest

from slurmft.rundir import RunDir, read_json
from slurmft.train.heartbeat import Heartbeat


def test_writes_every_k_steps_with_recent_step_time(tmp_path):
    clock = iter([100.0, 103.0]).__next__
    hb = Heartbeat(RunDir(tmp_path), "n1", job_id="9", restart_count=2, every=3, clock=clock)
    written = [hb.beat(step) for step in range(1, 7)]
    assert written == [False, False, True, False, False, True]
    data = read_json(RunDir(tmp_path).heartbeat("n1"))
    assert (data["step"], data["job_id"], data["restart_count"], data["node"]) == (6, "9", 2, "n1")
    assert data["recent_step_s"] == pytest.approx(1.0)
    assert data["time"] == 103.0
    assert sorted(p.name for p in (tmp_path / "heartbeat").iterdir()) == ["n1.json"]


def test_non_leaders_never_write(tmp_path):
    hb = Heartbeat(RunDir(tmp_path), "n1", job_id=None, restart_count=0, every=1, enabled=False)
    assert not hb.beat(1, force=True)
    assert not (tmp_path / "heartbeat").exists()


@pytest.mark.parametrize("node", ["", "../x", ".hidden"])
def test_node_names_that_escape_the_directory_are_refused(tmp_path, node):
    with pytest.raises(ValueError, match="node name"):
        Heartbeat(RunDir(tmp_path), node, job_id=None, restart_count=0)
