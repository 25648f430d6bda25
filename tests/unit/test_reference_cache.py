"""The integration tests' reference runs are made once per pytest run and shared by its xdist
workers (tests/integration/reference_cache.py): the second worker reads the first's result, bit
for bit, and waits for it while it is being made; outside xdist nothing is shared."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import reference_cache
import train_job_support

LOSSES = {1: (2.7183818531036377, 123456789), 2: (0.1 + 0.2, 42)}


def _counting(result, delay: float = 0.0):
    calls = []

    def make():
        calls.append(1)
        time.sleep(delay)
        return dict(result)
    return make, calls


def test_a_second_worker_reads_the_first_workers_reference_bit_for_bit(tmp_path):
    key = ("train_gpt.py", ("--tiny",), 2, ())
    make, calls = _counting(LOSSES)
    first = reference_cache.shared(tmp_path / "popen-gw0" / "t0" / "reference", key, make)
    second = reference_cache.shared(tmp_path / "popen-gw3" / "t9" / "reference", key, make)
    assert first == second == LOSSES and len(calls) == 1
    assert all(type(loss) is float and type(digest) is int for loss, digest in second.values())
    other = reference_cache.shared(tmp_path / "popen-gw3" / "t9" / "reference", (*key[:2], 3, ()), make)
    assert other == LOSSES and len(calls) == 2  # another key is another run
    assert not [p for p in (tmp_path / "references").iterdir() if ".tmp-" in p.name]


def test_a_worker_waits_for_the_reference_another_is_making(tmp_path):
    key = ("x",)
    slow, slow_calls = _counting(LOSSES, delay=1.0)
    fast, fast_calls = _counting({1: (0.0, 0)})
    got = {}
    maker = threading.Thread(target=lambda: got.setdefault(
        "first", reference_cache.shared(tmp_path / "popen-gw0" / "r", key, slow)))
    maker.start()
    while not (tmp_path / "references").exists():
        time.sleep(0.01)
    time.sleep(0.2)  # the maker holds the lock, inside its 1 s run
    got["second"] = reference_cache.shared(tmp_path / "popen-gw1" / "r", key, fast)
    maker.join(10)
    assert got == {"first": LOSSES, "second": LOSSES}
    assert (len(slow_calls), len(fast_calls)) == (1, 0)


def test_outside_xdist_each_process_makes_its_own():
    # Not under tmp_path: in `make test` that is inside this worker's popen-gwN basetemp, i.e.
    # under xdist, and the run was shared (a fresh-clone run failed so: 1 call, not 2).
    with tempfile.TemporaryDirectory(prefix="refcache-") as top:
        make, calls = _counting(LOSSES)
        for _ in range(2):
            assert reference_cache.shared(Path(top) / "run" / "reference", ("k",), make) == LOSSES
        assert len(calls) == 2 and not (Path(top) / "references").exists()


def test_reference_losses_makes_the_run_once_per_pytest_run(tmp_path, monkeypatch):
    runs = []

    def fake_run(run_dir, train_args, world_size, script, env):
        runs.append((run_dir, tuple(train_args)))
        return dict(LOSSES)
    monkeypatch.setattr(train_job_support, "_reference_run", fake_run)
    monkeypatch.setattr(train_job_support, "_REFERENCES", {})
    args = ["--tiny", "--steps", "2", "--step-sleep", "4.0", "--ckpt-every", "1"]
    assert train_job_support.reference_losses(tmp_path / "popen-gw0" / "a", args, 2) == LOSSES
    monkeypatch.setattr(train_job_support, "_REFERENCES", {})  # another worker's process
    assert train_job_support.reference_losses(tmp_path / "popen-gw1" / "b", args, 2) == LOSSES
    # Another checkpoint interval (the preemption test's beside the in-allocation tests'): the same run.
    other = ["--tiny", "--steps", "2", "--ckpt-every", "10"]
    assert train_job_support.reference_losses(tmp_path / "popen-gw1" / "c", other, 2) == LOSSES
    assert runs == [(tmp_path / "popen-gw0" / "a",  # no sleep, no saves (and REFERENCE_STEPS long)
                     ("--tiny", "--steps", str(train_job_support.REFERENCE_STEPS)))]


def test_train_gpt_references_are_one_run_of_reference_steps_cut_to_the_steps_asked(tmp_path, monkeypatch):
    runs = []
    long = {step: (float(step), step) for step in range(1, train_job_support.REFERENCE_STEPS + 11)}

    def fake_run(run_dir, train_args, world_size, script, env):
        runs.append(tuple(train_args))
        steps = int(train_args[train_args.index("--steps") + 1])
        return {s: v for s, v in long.items() if s <= steps}
    monkeypatch.setattr(train_job_support, "_reference_run", fake_run)
    monkeypatch.setattr(train_job_support, "_REFERENCES", {})
    ask = lambda n: train_job_support.reference_losses(  # noqa: E731
        tmp_path / "popen-gw0" / f"r{n}", ["--tiny", "--steps", str(n), "--ckpt-every", "5"], 2)
    assert ask(20) == {s: v for s, v in long.items() if s <= 20}
    assert ask(40) == {s: v for s, v in long.items() if s <= 40}
    assert ask(train_job_support.REFERENCE_STEPS + 10) == long  # longer: a run of its own
    assert runs == [("--tiny", "--steps", str(train_job_support.REFERENCE_STEPS)),
                    ("--tiny", "--steps", str(train_job_support.REFERENCE_STEPS + 10))]
