"""tests/helpers/warm_ranks.py, the unit tests' warm ranks (issue 28): a rank started through it is
forked from a server that imported torch, with the cold start's argv, environment, cwd, stdio and
exit code; signals a test sends a rank reach the rank's own process; a variable read at import
gets a server of its own, and the two ranks of a world do not share a string hash seed.

A server that could not warm would make every rank here run cold: these tests fail then (the
suite would still be right, only slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurmft.launch import warm

pytest_plugins = ("warm_ranks",)

REPORT = textwrap.dedent("""
    import json, os, sys
    warm = "torch" in sys.modules   # before this script imports anything
    import torch
    print(json.dumps({"warm": warm, "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv,
                      "cwd": os.getcwd(), "flag": os.environ.get("FLAG"), "rank": os.environ.get("RANK"),
                      "hash": hash("slurmft"), "threads": torch.get_num_threads(),
                      "stdin": sys.stdin.read()}))
    sys.exit(int(sys.argv[1]))
""")
SLEEP = "import time\nprint('up', flush=True)\ntime.sleep(300)\n"


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("PYTHONHASHSEED", None)   # cold starts then each draw their own
    return env


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _report(warm_ranks, tmp_path: Path, code: int, rank: int, **extra: str) -> tuple[dict, int]:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    proc = warm_ranks.popen([sys.executable, str(script), str(code)], env=_env(RANK=str(rank), **extra), rank=rank,
                            cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(b"from stdin", timeout=300)
    assert err == b"", err
    return json.loads(out), proc.returncode


@pytest.mark.timeout(400)
def test_a_rank_is_forked_warm_with_the_cold_starts_argv_env_cwd_stdio_and_exit_code(tmp_path, warm_ranks):
    seen, code = _report(warm_ranks, tmp_path, 7, 0, FLAG="yes")
    servers = {s.proc.pid for s in warm_ranks.servers.values()}
    assert seen["warm"] and seen["ppid"] in servers, seen   # forked from a server, torch already there
    assert code == 7
    assert seen["argv"] == [str(tmp_path / "report.py"), "7"]
    assert (seen["cwd"], seen["flag"], seen["rank"], seen["stdin"]) == (str(tmp_path), "yes", "0", "from stdin")
    assert seen["threads"] == 1   # the rank's OMP_NUM_THREADS, as a cold start reads it


@pytest.mark.timeout(400)
def test_ranks_of_one_world_hash_strings_differently_and_import_time_variables_get_their_own_server(
        tmp_path, warm_ranks):
    first, _ = _report(warm_ranks, tmp_path, 0, 0)
    again, _ = _report(warm_ranks, tmp_path, 0, 2)   # RANK is read late: the same server
    other, _ = _report(warm_ranks, tmp_path, 0, 1)
    assert again["ppid"] == first["ppid"] and other["ppid"] != first["ppid"]
    assert other["hash"] != first["hash"] == again["hash"]
    # read at import (slurmft.checkpoint.torch_compat): a server that imported with it
    public, _ = _report(warm_ranks, tmp_path, 0, 0, SLURMFT_TORCH_PUBLIC_ONLY="1")
    assert public["warm"] and public["ppid"] not in (first["ppid"], other["ppid"]), public


@pytest.mark.timeout(400)
def test_signals_and_kill_reach_the_rank_itself(tmp_path, warm_ranks):
    script = tmp_path / "sleep.py"
    script.write_text(SLEEP)
    procs = [warm_ranks.popen([sys.executable, str(script)], env=_env(), rank=r, stdout=subprocess.PIPE)
             for r in range(2)]
    try:
        for proc in procs:
            assert proc.stdout.readline() == b"up\n"
        workers = [warm_ranks.worker_pid(proc) for proc in procs]
        for proc, worker in zip(procs, workers):
            assert worker not in (None, proc.pid), worker
            assert int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1]) in {
                s.proc.pid for s in warm_ranks.servers.values()}
        warm_ranks.send_signal(procs[0], signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while _state(workers[0]) != "T":
            assert time.monotonic() < deadline, "the rank was not stopped"
            time.sleep(0.05)
        assert _state(procs[0].pid) != "T"   # the rank, not its client
        warm_ranks.kill_all(procs)
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
        deadline = time.monotonic() + 30   # SIGKILL is sent; the kernel ends the process when it runs
        for worker in workers:   # gone, or a zombie until its server reaps it
            while Path(f"/proc/{worker}").exists() and _state(worker) != "Z":
                assert time.monotonic() < deadline, f"rank {worker} outlived its SIGKILL"
                time.sleep(0.05)
    finally:
        warm_ranks.kill_all(procs)


RECORD = textwrap.dedent("""
    import importlib, json, os, sys
    read = set()

    class Recording(type(os.environ)):
        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

    os.environ = Recording(os.environ._data, os.environ.encodekey, os.environ.decodekey,
                           os.environ.encodevalue, os.environ.decodevalue)
    for name in sys.argv[1].split(","):
        importlib.import_module(name)
    print(json.dumps(sorted(read)))
""")


@pytest.mark.timeout(300)
def test_the_late_variables_are_not_read_by_the_servers_imports(tmp_path):
    import warm_ranks as helper

    _, defaults = warm.settings({})
    imports = ",".join(dict.fromkeys((*defaults, *helper.IMPORTS)))
    env = {**os.environ, **{name: "1" for name in helper.LATE}}
    proc = subprocess.run([sys.executable, "-c", RECORD, imports], env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = set(json.loads(proc.stdout.splitlines()[-1]))
    assert "SLURMFT_TORCH_PUBLIC_ONLY" in read   # the recording sees an import-time read
    assert not read & helper.LATE, read & helper.LATE
