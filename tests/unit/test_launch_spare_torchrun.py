"""A hot spare's torchrun started ahead (slurmft.launch.spare.ReadyTorchrun, launch/pretorchrun.py,
issue 27): real torchrun processes (standalone, one rank) and a real node task. While the spare
waits its torchrun is already started with torch imported; on activation it runs, and what it
passes on to its rank and its exit status are a cold torchrun's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import teardown_probe
from slurmft import allocation
from slurmft.launch import agent, spare, task
from slurmft.launch.allocation import fence, initial
from slurmft.rundir import RunDir

WAIT_S = 180.0   # a loaded 2-core box: torch imports take seconds each


def _children(name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and name.encode() in cmdline:
            pids.append(int(entry))
    return pids


def _torch_mapped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


def _rank_script(tmp_path: Path, out: Path) -> Path:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal, sys
        keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_RESTART_COUNT", "X_SPARE_TEST", "OMP_NUM_THREADS")
        seen = {{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keys}},
                "usr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN}}
        with open({str(out)!r}, "a") as f:
            f.write(json.dumps(seen) + "\\n")
        sys.exit(3)
    """))
    return script


def _argv(script: Path) -> list[str]:
    return [*agent.argv(), "--standalone", "--nproc-per-node=1",
            "--max-restarts=0", "--monitor-interval=0.2", str(script), "--flag", "v"]


def test_a_spares_torchrun_waits_imported_and_runs_as_a_cold_one_would(tmp_path, monkeypatch):
    out = tmp_path / "seen.jsonl"
    argv = _argv(_rank_script(tmp_path, out))
    monkeypatch.setenv("X_SPARE_TEST", "spare")
    probe = tmp_path / "probe"   # both torchruns end without the interpreter's teardown
    probed = teardown_probe.env(probe, [agent.MODULE, "slurmft.launch.pretorchrun"])
    monkeypatch.setenv("PYTHONPATH", probed["PYTHONPATH"])
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)   # task.main's: torchrun inherits it
    try:
        cold = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT_S)
    finally:
        signal.signal(signal.SIGUSR2, saved[signal.SIGUSR2])
    assert out.exists(), cold.stderr
    assert cold.stdout.endswith(teardown_probe.ATEXIT_TEXT) and not teardown_probe.tore_down(probe)
    cold_seen = json.loads(out.read_text())
    out.unlink()

    run = RunDir(tmp_path)
    first = initial("7", ("n1", "n2"), ("n3",), 2)
    allocation.write(run, first)
    monkeypatch.setenv("SLURMFT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("SLURMFT_JOB_ID", "7")
    monkeypatch.setenv(spare.SPARE_ENV, "n3")
    before: list = []

    def promote() -> None:
        deadline = time.monotonic() + WAIT_S
        ready: list[int] = []
        while time.monotonic() < deadline:
            ready = [p for p in _children("slurmft.launch.pretorchrun") if _torch_mapped(p)]
            if ready:
                break
            time.sleep(0.2)
        time.sleep(1.0)   # still waiting, imported, with nothing run
        before.append((bool(ready), out.exists()))
        allocation.write(run, fence(first, "n2", "node_silent", 1.0, ["x"], "n3"))

    thread = threading.Thread(target=promote)
    thread.start()
    try:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)   # task.main's
        rc = task.supervise(argv, run.alive("n3"))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    thread.join(WAIT_S)
    assert before == [(True, False)]   # torch imported in the waiting torchrun, no rank yet
    # torchrun's status (the rank's 3 -> its ChildFailedError -> 1) and what it passed on
    assert rc == cold.returncode == 1
    assert not teardown_probe.tore_down(probe), "the spare's torchrun ran the interpreter's teardown"
    assert json.loads(out.read_text()) == cold_seen
    assert cold_seen["argv"] == ["--flag", "v"] and cold_seen["usr2_ignored"] is True
    assert cold_seen["env"]["X_SPARE_TEST"] == "spare" and cold_seen["env"]["WORLD_SIZE"] == "1"


def test_a_spare_never_activated_ends_its_waiting_torchrun_having_run_nothing(tmp_path):
    out = tmp_path / "seen.jsonl"
    ready = spare.ReadyTorchrun.start(_argv(_rank_script(tmp_path, out)), None)
    assert ready is not None
    deadline = time.monotonic() + WAIT_S
    while not _torch_mapped(ready.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    ready.cancel()
    assert ready.proc.returncode in (0, -signal.SIGTERM) and not out.exists()


def test_only_torchruns_own_command_is_started_ahead(tmp_path):
    assert spare.ReadyTorchrun.start([sys.executable, "-c", "pass"], None) is None
    assert spare.ReadyTorchrun.start([sys.executable], None) is None


def test_a_waiting_torchrun_that_died_is_started_cold_on_activation(tmp_path):
    out = tmp_path / "seen.jsonl"
    argv = _argv(_rank_script(tmp_path, out))
    ready = spare.ReadyTorchrun.start(argv, None)
    assert ready is not None
    ready.proc.kill()
    ready.proc.wait(timeout=WAIT_S)
    proc = ready.go(None)
    assert proc is not ready.proc and proc.wait(timeout=WAIT_S) == 1 and out.exists()
