"""Heartbeat file: written by node leaders in wall time (at the segment's first step boundary, then
at the first boundary ``interval_s`` after the last write), atomically, each beat with the last
step's duration; long phases announce themselves with their bound."""

import pytest

from slurmft.rundir import RunDir, read_json
from slurmft.train.heartbeat import Heartbeat


class Clock:
    """One fake clock for the wall time and the monotonic one (``wall_offset`` steps the wall)."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self.wall_offset = 0.0

    def wall(self) -> float:
        return self.now + self.wall_offset

    def mono(self) -> float:
        return self.now


def heartbeat(tmp_path, clock: Clock, **kw) -> Heartbeat:
    return Heartbeat(RunDir(tmp_path), "n1", job_id="9", restart_count=2, clock=clock.wall,
                     monotonic=clock.mono, **kw)


def read(tmp_path) -> dict:
    return read_json(RunDir(tmp_path).heartbeat("n1"))


def test_short_steps_beat_every_interval_long_steps_every_step(tmp_path):
    clock = Clock()
    hb = heartbeat(tmp_path, clock, interval_s=10)
    written = []
    for step in range(1, 13):  # 3 s steps: the first boundary, then the first one 10 s later
        clock.now += 3
        written.append(hb.beat(step))
    assert written == [True, False, False, False, True, False, False, False, True, False, False, False]
    data = read(tmp_path)
    assert (data["step"], data["job_id"], data["restart_count"], data["node"]) == (9, "9", 2, "n1")
    assert data["last_step_s"] == pytest.approx(3.0) and data["interval_s"] == 10
    assert data["time"] == clock.now - 9
    for step in range(13, 16):  # 12 s steps: every boundary
        clock.now += 12
        assert hb.beat(step)
    assert read(tmp_path)["last_step_s"] == pytest.approx(12.0)
    assert sorted(p.name for p in (tmp_path / "heartbeat").iterdir()) == ["n1.json"]


def test_the_first_beat_carries_the_first_steps_time(tmp_path):
    # The old steps-based heartbeat wrote nothing before step 10, and then no step time.
    clock = Clock()
    hb = heartbeat(tmp_path, clock)
    clock.now += 45  # one long first step (compilation)
    assert hb.beat(1)
    assert read(tmp_path)["last_step_s"] == pytest.approx(45.0)


def test_step_times_ignore_a_wall_clock_step(tmp_path):
    clock = Clock()
    hb = heartbeat(tmp_path, clock, interval_s=0)
    clock.now += 1
    hb.beat(1)
    clock.wall_offset = 3600.0  # NTP steps the wall clock an hour
    clock.now += 1
    hb.beat(2)
    data = read(tmp_path)
    assert data["last_step_s"] == pytest.approx(1.0) and data["time"] == clock.now + 3600


def test_a_phase_announces_its_bound_and_its_end_and_does_not_count_as_step_time(tmp_path):
    clock = Clock()
    hb = heartbeat(tmp_path, clock, interval_s=10)
    clock.now += 2
    hb.beat(1)
    clock.now += 1  # step 2 under way, then an evaluation inside it
    with hb.phase("evaluation", bound_s=1800):
        data = read(tmp_path)
        assert (data["phase"], data["phase_bound_s"], data["step"]) == ("evaluation", 1800, 1)
        assert data["last_step_s"] == pytest.approx(2.0)  # the last finished step's, from the start
        clock.now += 600
        with hb.phase("checkpoint save of step 1", bound_s=100):  # nested: the innermost is named
            assert read(tmp_path)["phase"] == "checkpoint save of step 1"
            clock.now += 50
        data = read(tmp_path)  # back in the outer phase, with what is left of its bound
        assert data["phase"] == "evaluation" and data["phase_bound_s"] == pytest.approx(1200)
    data = read(tmp_path)
    assert "phase" not in data and data["time"] == clock.now
    clock.now += 1
    hb.beat(2, force=True)
    assert read(tmp_path)["last_step_s"] == pytest.approx(2.0)  # 1 s + 1 s, the phases left out


def test_non_leaders_never_write(tmp_path):
    hb = Heartbeat(RunDir(tmp_path), "n1", job_id=None, restart_count=0, interval_s=0, enabled=False)
    assert not hb.beat(1, force=True)
    with hb.phase("checkpoint load", bound_s=60):
        pass
    assert not (tmp_path / "heartbeat").exists()


def test_busy_time_is_asked_for_only_when_a_beat_is_written(tmp_path):
    clock = Clock()
    hb = heartbeat(tmp_path, clock, interval_s=10)
    asked = []

    def busy():
        asked.append(clock.now)
        return 0.25

    for step in range(1, 5):
        clock.now += 1
        hb.beat(step, busy_s=busy)
    assert asked == [101.0] and read(tmp_path)["busy_s"] == 0.25


@pytest.mark.parametrize("node", ["", "../x", ".hidden"])
def test_node_names_that_escape_the_directory_are_refused(tmp_path, node):
    with pytest.raises(ValueError, match="node name"):
        Heartbeat(RunDir(tmp_path), node, job_id=None, restart_count=0)


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_negative_interval_or_bound_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="interval_s"):
        Heartbeat(RunDir(tmp_path), "n1", job_id=None, restart_count=0, interval_s=bad)
    hb = Heartbeat(RunDir(tmp_path), "n1", job_id=None, restart_count=0)
    with pytest.raises(ValueError, match="bound_s"):
        with hb.phase("x", bound_s=bad):
            pass


def test_each_beat_names_torchruns_attempt(tmp_path):
    hb = Heartbeat(RunDir(tmp_path), "n1", job_id="7", restart_count=1, attempt=3)
    hb.beat(1, force=True)
    assert (read(tmp_path)["restart_count"], read(tmp_path)["attempt"]) == (1, 3)
