"""``benchmarks/rdzv_log.py`` on real captured job logs (tests/fixtures/rdzv/README.md): the
re-formation after a fence, how long its round took and whose compare-and-set writes lost."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "rdzv"
sys.path.insert(0, str(REPO / "benchmarks"))

import rdzv_log  # noqa: E402


def rows(name: str) -> list[rdzv_log.Reform]:
    return rdzv_log.reforms((FIXTURES / name).read_text().splitlines())


def test_the_old_one_second_keep_alive_round_lost_the_completing_write_again_and_again():
    (reform,) = rows("reform_keepalive_1x5_throttled.log")
    assert (reform.fenced, reform.cause) == ("n3", "node_silent")
    assert reform.action == "replaced by the spare n4"
    assert (reform.round, reform.world_size, reform.joins) == (1, 3, 3)
    assert reform.first_join_s == 1.001 and reform.joined_s == 50.08
    assert reform.round_s == 49.079
    assert reform.completed_by == "localhost_10116_0"
    assert reform.lost_by == {"localhost_10116_0": 26, "localhost_10121_0": 4,
                              "localhost_10106_0": 3}
    assert reform.lost_writes == 33


def test_at_two_seconds_by_three_the_same_load_costs_a_few_writes():
    (reform,) = rows("reform_keepalive_2x3_throttled.log")
    assert (reform.round, reform.world_size, reform.joins) == (1, 3, 3)
    assert reform.round_s is not None and reform.round_s < 6
    assert reform.lost_writes == 5 and reform.lost_by[reform.completed_by] == 3


def test_the_table_and_the_errors(tmp_path, capsys):
    assert rdzv_log.main([str(FIXTURES / "reform_keepalive_1x5_throttled.log")]) == 0
    out = capsys.readouterr().out
    assert "| n3 | node_silent | 1.0 | 50.1 | 49.1 | 33 | localhost_10116_0 (26) |" in out

    no_debug = tmp_path / "job.log"
    no_debug.write_text("slurmft-launch[job 1 restart 0 01:08:27]: n3 node_silent: no beat -> "
                        "replaced by the spare n4 (generation 1)\n"
                        "slurmft-launch[job 1 restart 0 01:09:30]: n2 node_down: Slurm shows n2 "
                        "DOWN -> dropped: training goes on on 2 node(s) (generation 2)\n")
    assert [(r.fenced, r.action) for r in rdzv_log.reforms(no_debug.read_text().splitlines())] == [
        ("n3", "replaced by the spare n4"), ("n2", "dropped: training goes on on 2 node(s)")]
    assert rdzv_log.main([str(no_debug)]) == 1
    assert "no torch rendezvous debug lines" in capsys.readouterr().err

    no_fence = tmp_path / "quiet.log"
    no_fence.write_text("slurmft warm server[1]: rank 0 (attempt 0) forked warm as pid 2\n")
    assert rdzv_log.main([str(no_fence)]) == 1
    assert "no fence" in capsys.readouterr().err
    assert rdzv_log.main([str(tmp_path / "absent.log")]) == 1
    assert "absent.log" in capsys.readouterr().err
