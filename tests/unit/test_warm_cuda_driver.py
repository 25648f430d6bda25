"""The warm server's CUDA check (``slurmft.launch.cudafork``): a CUDA driver library mapped in the
server but not initialised lets it fork its workers; one that was initialised, or that cannot be
asked, makes it refuse (its clients run their ranks cold).

Why: on a real GPU node (an H200, torch 2.11+cu130, driver 580.159.04; ``benchmarks/gpu_check.py``
2026-11-27) the default imports map ``libcuda.so`` without initialising it, and the server refused
on the mapping alone: warm workers were off on every GPU node. There is no GPU here, so the driver
is a stand-in built with the C compiler: a ``libcuda.so.1`` whose ``cuDeviceGetCount`` answers as
the real one does before ``cuInit`` (3, CUDA_ERROR_NOT_INITIALIZED) or after it (0). Real server
and client processes, as in test_launch_warm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from slurmft.launch import warmclient, warmtask

PY = sys.executable
WAIT_S = 120.0   # a loaded 2-core box: bound every wait generously


def _fake_driver(tmp_path: Path, status: int) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "no C compiler to build the stand-in CUDA driver library (make install puts gcc in)"
    src = tmp_path / "fake_cuda.c"
    src.write_text(f"int cuDeviceGetCount(int *count) {{ *count = 0; return {status}; }}\n")
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=WAIT_S)
    return lib


def _serve_one(tmp_path: Path, lib: Path) -> tuple[dict, str, int]:
    """A server whose imports load ``lib`` (as a module calling the driver without torch would),
    one client; (what the rank printed, the server's log, the server's pid)."""
    (tmp_path / "drivercall.py").write_text(f"import ctypes\nctypes.CDLL({str(lib)!r})\n")
    script = tmp_path / "who.py"
    script.write_text("import json, os\nprint(json.dumps({'ppid': os.getppid()}))\n")
    sock_dir = tempfile.mkdtemp(prefix="slurmft-warm-test-", dir="/tmp")
    path = os.path.join(sock_dir, "s")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([PY, "-m", "slurmft.launch.warm", "--socket", path, "--imports",
                               "json,drivercall"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        res = subprocess.run([PY, "-I", "-S", warmclient.__file__, "--", str(script)], cwd=tmp_path,
                             env={**env, warmclient.SOCKET_ENV: path}, capture_output=True, text=True,
                             timeout=WAIT_S)
    finally:
        warmtask.stop_server(server, path)
    log = server.stderr.read() if server.stderr else ""
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), log + res.stderr, server.pid


def test_a_mapped_driver_that_was_not_initialised_lets_the_server_fork(tmp_path):
    lib = _fake_driver(tmp_path, 3)   # CUDA_ERROR_NOT_INITIALIZED: nobody called cuInit
    rank, log, server_pid = _serve_one(tmp_path, lib)
    assert rank["ppid"] == server_pid, log          # forked warm (the old check refused here)
    assert "no warm workers" not in log and "starting this rank cold" not in log


def test_a_mapped_driver_that_was_initialised_makes_the_server_refuse(tmp_path):
    lib = _fake_driver(tmp_path, 0)   # CUDA_SUCCESS: the driver was initialised
    rank, log, server_pid = _serve_one(tmp_path, lib)
    assert rank["ppid"] != server_pid and "starting this rank cold" in log
    refusals = [line for line in log.splitlines() if "no warm workers on this node" in line]
    assert len(refusals) == 1, log
    assert f"CUDA driver library {lib} and it was initialised (cuDeviceGetCount returned 0" in refusals[0]
