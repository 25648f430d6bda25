"""In-allocation mode's parts: its settings, allocation.json, the node beats (task and
liveness) and each node's step argv. The loop itself runs on the devcluster
(tests/integration/test_inalloc.py) and in test_launch_inalloc_fence.py."""

import json
import sys
import threading

import pytest

from launch_envs import recorded
from slurmft import allocation as record
from slurmft.launch import agent, alloc_settings, allocation, identity, liveness, nodesteps, settings, task
from slurmft.launch.rendezvous import Rendezvous
from slurmft.rundir import RunDir

pytestmark = pytest.mark.timeout(60)
FOUR = {**recorded("nonarray"), "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NNODES": "4", "SLURMFT_RUN_DIR": "/runs/a"}


def _alloc(**env):
    full = {**FOUR, **env}
    return alloc_settings.from_environ(full, identity.from_environ(full))


# -- settings ---------------------------------------------------------------------------------

def test_the_mode_is_off_unless_spares_or_the_flag_turn_it_on():
    assert _alloc() is None and _alloc(SLURMFT_SPARE_NODES="0") is None
    assert _alloc(SLURMFT_IN_ALLOCATION="0") is None


def test_spares_are_the_last_nodes_and_the_batch_host_always_trains():
    a = _alloc(SLURMFT_SPARE_NODES="1")
    assert (a.active, a.spares, a.min_nodes) == (("n1", "n2", "n3"), ("n4",), 3)
    assert (a.node_silent_s, a.alloc_restarts, a.node_poll_s) == (5.0, 3, 10.0)
    # A batch host that is not the first node stays active and is never a spare.
    b = _alloc(SLURMFT_SPARE_NODES="2", SLURMD_NODENAME="n4")
    assert (b.active, b.spares) == (("n4", "n1"), ("n2", "n3"))


def test_the_flag_alone_is_shrink_only_down_to_min_nodes():
    a = _alloc(SLURMFT_IN_ALLOCATION="1", SLURMFT_MIN_NODES="2", SLURMFT_NODE_SILENT_S="5",
               SLURMFT_ALLOC_RESTARTS="7", SLURMFT_NODE_POLL_S="2.5")
    assert (a.active, a.spares, a.min_nodes, a.node_silent_s, a.alloc_restarts, a.node_poll_s) == \
        (("n1", "n2", "n3", "n4"), (), 2, 5.0, 7, 2.5)


@pytest.mark.parametrize("env, named", [
    ({"SLURMFT_SPARE_NODES": "4"}, "SLURMFT_SPARE_NODES='4' must be between 0 and 3"),
    ({"SLURMFT_SPARE_NODES": "x"}, "SLURMFT_SPARE_NODES='x' must be an integer"),
    ({"SLURMFT_SPARE_NODES": "-1"}, "SLURMFT_SPARE_NODES='-1' must be between 0 and 3"),
    ({"SLURMFT_IN_ALLOCATION": "yes"}, "SLURMFT_IN_ALLOCATION='yes' must be 0 or 1"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_MIN_NODES": "4"}, "SLURMFT_MIN_NODES='4' must be between 1 and 3"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_MIN_NODES": "0"}, "SLURMFT_MIN_NODES='0' must be between 1 and 3"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_NODE_SILENT_S": "1"}, "SLURMFT_NODE_SILENT_S='1' must be between 2"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_NODE_SILENT_S": "nan"}, "SLURMFT_NODE_SILENT_S='nan' must be"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_NODE_POLL_S": "1"}, "SLURMFT_NODE_POLL_S='1' must be between 2"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_NODE_POLL_S": "inf"}, "SLURMFT_NODE_POLL_S='inf' must be"),
    ({"SLURMFT_SPARE_NODES": "1", "SLURMFT_ALLOC_RESTARTS": "2.5"}, "SLURMFT_ALLOC_RESTARTS='2.5' must be"),
])
def test_a_bad_value_is_one_error_naming_the_variable(env, named):
    with pytest.raises(settings.SettingsError) as err:
        _alloc(**env)
    assert str(err.value).startswith(named) and "\n" not in str(err.value)


# -- allocation.json (the record and its reader: slurmft.allocation, tests/unit of its own) -----

BASE = allocation.initial("7_1", ("n1", "n2", "n3"), ("n4",), 3)


def test_fencing_an_active_node_puts_the_spare_in_its_place_and_moves_the_generation():
    a = allocation.fence(BASE, "n2", "node_silent", 100.0, ["no beat for 10 s"], "n4")
    assert (a.generation, a.active, a.spares, a.fenced_nodes) == (1, ("n1", "n4", "n3"), (), ("n2",))
    shrunk = allocation.fence(a, "n3", "node_death", 101.0, ["gone"], None)
    assert (shrunk.generation, shrunk.active, shrunk.fenced_nodes) == (2, ("n1", "n4"), ("n2", "n3"))


def test_fencing_a_spare_leaves_the_generation_alone():
    a = allocation.fence(BASE, "n4", "node_silent", 100.0, ["x"], None)
    assert (a.generation, a.active, a.spares, a.fenced_nodes) == (0, BASE.active, (), ("n4",))


def test_what_the_launcher_writes_every_reader_takes_back(tmp_path):
    a = allocation.fence(BASE, "n2", "node_silent", 100.5, ["e" * 5000] * 100, "n4")
    record.write(RunDir(tmp_path), a)
    raw = json.loads(RunDir(tmp_path).allocation.read_text())
    assert raw["version"] == 1 and raw["job_id"] == "7_1" and raw["min_nodes"] == 3
    assert raw["fenced"][0]["node"] == "n2" and len(raw["fenced"][0]["evidence"]) == record.MAX_EVIDENCE
    assert all(len(e) == record.MAX_TEXT for e in raw["fenced"][0]["evidence"])
    back = record.read(RunDir(tmp_path))
    assert back == a
    assert [p.name for p in tmp_path.iterdir()] == ["allocation.json"]  # no temp file left


# -- beats ------------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_silence_is_measured_from_the_last_change_seen_on_our_clock(tmp_path):
    run, clock = RunDir(tmp_path), Clock()
    path = run.alive("n2")
    path.parent.mkdir()
    path.write_text(json.dumps({"seq": 9, "pid": 1, "step_id": "3", "time": 1e12}))  # an old run's
    live = liveness.Liveness(run, startup_s=30, clock=clock)
    live.expect("n2")
    clock.now += 20
    live.poll()
    assert not live.has_beaten("n2") and not live.silent("n2", 5)  # startup grace: 30 s
    clock.now += 11
    assert live.silent("n2", 5)
    path.write_text(json.dumps({"seq": 1, "pid": 2, "step_id": "4", "time": 0}))
    live.poll()
    assert live.has_beaten("n2") and not live.silent("n2", 5) and live.step_id("n2") == "4"
    clock.now += 5.5
    live.poll()  # the same beat again is no beat; but the file alone needs FILE_ALONE_S
    assert not live.silent("n2", 5) and live.silent_s("n2") == pytest.approx(5.5)
    clock.now += liveness.FILE_ALONE_S - 5
    assert live.silent("n2", 5) and live.silent_s("n2") == pytest.approx(10.5)


@pytest.mark.parametrize("content", ['{"seq": "1", "pid": 1}', "[]", "garbage", '{"seq": 1}'])
def test_a_beat_that_is_not_one_counts_for_nothing(tmp_path, content):
    path = tmp_path / "b.json"
    path.write_text(content)
    assert liveness.read_beat(path) is None


def test_a_step_id_that_is_not_digits_is_not_used(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"seq": 1, "pid": 1, "step_id": "3;rm -rf /"}))
    assert liveness.read_beat(path) == ((1, 1), None, None)


def test_the_task_beats_while_its_child_runs_and_says_how_it_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_STEP_ID", "5")
    alive = RunDir(tmp_path).alive("n1")
    code = "import time, sys; time.sleep(2.5); sys.exit(3)"
    assert task.supervise([sys.executable, "-c", code], alive) == 3
    mark, step, ended = liveness.read_beat(alive)
    assert step == "5" and ended == 3 and mark[1] > 2  # beats went on, then the last one


def test_beats_go_on_every_period_until_stopped(tmp_path):
    path, stop = tmp_path / "alive.json", threading.Event()
    seqs = []
    thread = threading.Thread(target=lambda: seqs.append(task.beat_forever(path, stop, 0.05)))
    thread.start()
    while (liveness.read_beat(path) or ((0, 0),))[0][1] < 3:
        pass
    stop.set()
    thread.join(5)
    assert seqs and seqs[0] >= 3


def test_an_explicit_rdzv_conf_is_left_as_the_launcher_wrote_it():
    argv = [*agent.argv("/py"), "--rdzv-conf=is_host=0,x=1", "x.py"]
    assert task.argv_for_node(argv, "0") == argv


# -- one step per node ------------------------------------------------------------------------

def test_each_node_runs_its_own_step_and_only_the_batch_host_holds_the_store():
    a = _alloc(SLURMFT_SPARE_NODES="1", SLURMFT_MIN_NODES="2", SLURMFT_NODE_SILENT_S="10")
    full = {**FOUR, "SLURMFT_NPROC_PER_NODE": "2"}
    cfg = settings.from_environ(full, identity.from_environ(full))
    rdzv = Rendezvous("n1", 40001, "slurmft-1-0")
    host = nodesteps.node_argv("n1", rdzv, a, cfg, ["train.py", "--x"], python="/py")
    other = nodesteps.node_argv("n4", rdzv, a, cfg, ["train.py", "--x"], python="/py")
    assert host[:6] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=n1", "--kill-on-bad-exit=0",
                        "--job-name=slurmft-train"]
    assert "--nodelist=n4" in other
    for argv, is_host in ((host, 1), (other, 0)):
        assert "--nnodes=2:3" in argv and "--nproc-per-node=2" in argv
        assert "--rdzv-endpoint=n1:40001" in argv and argv[-2:] == ["train.py", "--x"]
        conf = next(x for x in argv if x.startswith("--rdzv-conf="))
        assert conf.startswith(f"--rdzv-conf=is_host={is_host},")
    # torchrun's expiry of a dead participant is the launcher's silence bound rounded up to whole
    # intervals, less than one interval past it (a world re-formed before the fence is not ended by
    # it: slurmft.train.alloc_watch); at least 2 intervals + 2 s, so that a live node whose
    # keep-alive is interval + ~1 s old when its join returns is not dropped before its agent's
    # timer refreshes it an interval later; the interval a third of the bound
    # (test_rendezvous_keep_alive.py: why not 1 s).
    for silent in (2, 3, 4.5, 5, 7, 10, 120):
        interval, attempts = nodesteps.keep_alive(silent)
        expiry = interval * attempts
        assert silent <= expiry and expiry >= 2 * interval + 2, (silent, interval, attempts)
        assert expiry < silent + interval or interval == 1, (silent, interval, attempts)
    assert nodesteps.keep_alive(5) == (2, 3) and nodesteps.keep_alive(10) == (4, 3)
    assert nodesteps.keep_alive(2) == (1, 4)
    assert "keep_alive_interval=4,keep_alive_max_attempt=3," in conf and "last_call_timeout=3" in conf
