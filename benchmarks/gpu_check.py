"""What slurmft does on a real GPU: NVML and the sweep's GPU checks, checkpoint staging from GPU
memory, NCCL through ``Run``, warm workers forking CUDA ranks, and busy.py's CUDA-event timing.

    python benchmarks/gpu_check.py [--out DIR] [--size-gb 1.5] [--only PART,...] [--json]

Parts (each in its own process with its own time bound; one that breaks is reported and the
others still run):

* ``nvml``: ``slurmft.health.gpu.gather_gpus`` on the real NVML, every GPU check of the registry
  (the sweep's ``--quick`` plan and the GPU checks of its normal plan), ``nvidia-smi -q`` kept
  (``DIR/nvidia-smi-q.txt``) to compare with, and ``slurmft sweep --quick --dry-run --json`` itself.
* ``warm``: a warm server (``slurmft.launch.warm``) with the default imports forks a rank that
  initialises CUDA and NCCL and trains through ``Run``; servers whose imports initialise CUDA or
  load the CUDA driver refuse, and their clients run the rank cold.
* ``nccl``: a world of 1 on the NCCL backend through ``Run`` (``_gpu_train.py``): ``report()``'s
  cost per step, heartbeats, a periodic and a final save, then a second process that resumes and
  finds the state bit-equal.
* ``busy``: ``slurmft.train.busy.ForwardTimer`` on a CUDA module: the event time against the wall
  time of the same forwards, and whether its hooks sync the host.
* ``restart``: what a rank's restart costs on a GPU, phase by phase (launch, imports, CUDA
  context, NCCL communicator, model, ``Run`` entered with the checkpoint restored, first and
  second step): one run saves at step 8, then cold ranks (a new interpreter) and warm ranks
  (forked by a warm server started beforehand, as a node's is) take turns resuming the newest
  checkpoint (the previous trial's final save), each two steps past it; the ``restart_phases``
  the ranks journaled come with them.
* ``inplace``: a rank crash restarted in place on the GPU by torchrun, as a node's agent does it
  in the allocation (``python -m slurmft.launch.agent``, standalone, ``--max-restarts=1``): the
  rank raises at step 6 (a checkpoint at 4), torchrun starts the next attempt, which resumes at 4
  and trains to 8; once with warm ranks (the node's warm server started first, the workers its
  clients) and once cold. From the crash to the new attempt's first step, by phase.
* ``ckpt``: ``_gpu_ckpt.py``: how long a save from GPU memory blocks the loop against the whole
  save, slurmft against ``dcp.async_save``, and a bit-exact restore on the GPU.

Without a GPU (no CUDA in torch, or NVML sees none) the parts that need one say so in one line
and are skipped; ``nvml`` then reports what NVML said. Prints a table, or one JSON object with
``--json``; ``DIR/gpu_check.json`` always gets the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = ("nvml", "warm", "nccl", "restart", "inplace", "busy", "ckpt")
PART_TIMEOUT_S = {"nvml": 60, "warm": 120, "nccl": 120, "restart": 200, "inplace": 150, "busy": 60,
                  "ckpt": 240}
RESTART_TRIALS = 2  # per kind (cold, warm), alternating


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), str(HERE), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def _tail(text: str, n: int = 15) -> str:
    return "\n".join((text or "").splitlines()[-n:])


def _cuda_available() -> tuple[bool, str]:
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, "
                            "torch.cuda.is_available(), torch.cuda.device_count())"],
                           env=_env(PYTORCH_NVML_BASED_CUDA_CHECK="1"), capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        return False, f"torch does not import: {_tail(probe.stderr, 3)}"
    version, available, count = probe.stdout.split()
    if available != "True":
        return False, f"torch {version} sees no CUDA GPU"
    return True, f"torch {version}, {count} CUDA device(s)"


# ----------------------------------------------------------------------------- nvml + sweep


def part_nvml(out: Path, tmp: Path) -> dict[str, Any]:
    from slurmft.health.facts import Unavailable
    from slurmft.health.gpu import gather_gpus
    from slurmft.health.registry import HealthConfig, plan, run_plan
    from slurmft.health.state import HealthState

    result: dict[str, Any] = {}
    try:
        smi = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=30)
        (out / "nvidia-smi-q.txt").write_text(smi.stdout)
        result["nvidia_smi_rc"] = smi.returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        result["nvidia_smi_error"] = str(exc)
    t0 = time.monotonic()
    facts = gather_gpus()
    result["gather_s"] = time.monotonic() - t0
    if isinstance(facts, Unavailable):
        result["facts"] = {"unavailable": facts.reason}
    else:
        result["facts"] = {"driver": facts.driver,
                           "devices": [_plain(dataclasses.asdict(d)) for d in facts.devices]}
        (out / "nvml-facts.json").write_text(json.dumps(result["facts"], indent=1, sort_keys=True))
    hc = HealthConfig()
    gpu_names = tuple(n for n in ("gpu_count", "gpu_ecc", "gpu_memory_remap", "gpu_recovery_action",
                                  "gpu_temperature", "gpu_throttle", "gpu_pcie", "gpu_nvlink"))
    for label, names, mode in (("gpu_checks_normal", gpu_names, "normal"), ("quick_plan", (), "quick")):
        results, _ = run_plan(plan(names, hc, mode), hc, HealthState(), 20.0)  # type: ignore[arg-type]
        result[label] = [{"check": r.check, "status": str(getattr(r.status, "value", r.status)),
                          "detail": r.detail} for r in results]
    cfg = tmp / "sweep.toml"
    cfg.write_text(f'[sweep]\nstate_dir = "{tmp}/state"\nreport_dir = "{tmp}/reports"\n'
                   f'textfile_dir = "{tmp}/textfile"\n')
    cli = subprocess.run([sys.executable, "-c", "from slurmft.cli import main; main()", "sweep",
                          "--quick", "--dry-run", "--json", "--config", str(cfg)],
                         env=_env(), capture_output=True, text=True, timeout=60)
    result["sweep_cli"] = {"rc": cli.returncode, "stderr": _tail(cli.stderr, 10)}
    try:
        result["sweep_cli"]["report"] = json.loads(cli.stdout)
    except ValueError:
        result["sweep_cli"]["stdout"] = _tail(cli.stdout, 20)
    return result


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset, list, tuple)):
        return sorted(_plain(v) for v in obj) if isinstance(obj, (set, frozenset)) else [_plain(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- ranks


def _rank_env(run_dir: Path, **extra: str) -> dict[str, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLURMFT_RUN_DIR=str(run_dir),
                **extra)


def _run(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """``argv`` in a session of its own: (its exit status, its stderr); past ``timeout`` the whole
    session is killed (torchrun's ranks with it, so none keeps the GPU) and the status is None."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:  # a warm worker (the server's child, outside the session) may hold the pipe a while
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            err = ""
        return None, f"{err}\ngpu_check: killed after {timeout:.0f} s"


def _train(argv: list[str], env: dict[str, str], result: Path, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    env = {**env, "GPU_CHECK_T0": repr(time.time())}
    rc, stderr = _run(argv, env, _bound(timeout))
    got: dict[str, Any] = {"rc": rc, "wall_s": time.monotonic() - t0}
    if result.exists():
        got.update(json.loads(result.read_text()))
    if rc != 0 or not result.exists():
        got["stderr"] = _tail(stderr, 25)
    return got


def _train_args(out: Path, steps: int, interval: int, **kw: str) -> list[str]:
    args = [str(HERE / "_gpu_train.py"), "--steps", str(steps), "--interval", str(interval),
            "--out", str(out)]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}", value]
    return args


def part_nccl(out: Path, tmp: Path) -> dict[str, Any]:
    from slurmft import journal
    from slurmft.rundir import RunDir

    run_dir, dump = tmp / "nccl-run", tmp / "state-12.pt"
    first = _train([sys.executable, *_train_args(tmp / "r1.json", 12, 8, dump=str(dump))],
                   _rank_env(run_dir), tmp / "r1.json", 90)
    beats = sorted((run_dir / "heartbeat").glob("*.json")) if (run_dir / "heartbeat").is_dir() else []
    first["heartbeats"] = [json.loads(b.read_text()) for b in beats]
    second = _train([sys.executable, *_train_args(tmp / "r2.json", 16, 8, expect_step="12",
                                                  compare=str(dump))],
                    _rank_env(run_dir), tmp / "r2.json", 90)
    events = [e.kind for e in journal.read_events(RunDir(run_dir).events)]
    return {"first": first, "resumed": second, "journal_events": events,
            "run_dir_files": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())[:40]}


def _server(env: dict[str, str], log: Path):
    """``warmtask.start_server`` as the node's task calls it, its stderr into ``log``."""
    from slurmft.launch import warmtask

    saved = os.dup(2)
    with open(log, "wb") as f:
        os.dup2(f.fileno(), 2)
        try:
            return warmtask.start_server(env)
        finally:
            os.dup2(saved, 2)
            os.close(saved)


_IMPORT_PROBE = """
import importlib, json, sys
from slurmft.launch import warm, warmtask
from slurmft.launch.cudafork import cuda_driver_mapped, driver_initialised
rows = []
for name in warm.DEFAULT_IMPORTS:
    importlib.import_module(name)
    path = cuda_driver_mapped()
    rows.append([name, path, None if path is None else (driver_initialised(path) or "not initialised")])
print(json.dumps(rows))
"""


def _driver_after_imports() -> Any:
    """After each of the warm server's default imports (in order, one fresh process): the CUDA
    driver library mapped, if any, and what it says of its initialisation."""
    probe = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], env=_env(PYTORCH_NVML_BASED_CUDA_CHECK="1",
                           OPENBLAS_NUM_THREADS="1"), capture_output=True, text=True, timeout=_bound(60))
    if probe.returncode != 0:
        return {"error": _tail(probe.stderr, 8)}
    return json.loads(probe.stdout)


def part_warm(out: Path, tmp: Path) -> dict[str, Any]:
    from slurmft.launch import warm, warmclient, warmtask

    result: dict[str, Any] = {"driver_after_each_import": _driver_after_imports()}
    # 1. default imports: the server must serve, its worker must get CUDA and NCCL.
    env = _rank_env(tmp / "warm-run")
    proc, path, lock = _server(env, tmp / "server-default.log")
    try:
        env[warmclient.SOCKET_ENV] = path
        command = warm.worker_command(_train_args(tmp / "w.json", 6, 3))
        got = _train(command, env, tmp / "w.json", 100)
        got["server_pid"] = proc.pid
        got["forked_by_server"] = got.get("ppid") == proc.pid
        result["default_imports"] = got
    finally:
        warmtask.stop_server(proc, path, lock)
    result["default_imports"]["server_log"] = _tail((tmp / "server-default.log").read_text(), 10)
    # 2. imports that touch CUDA: the server refuses, the client runs its rank cold.
    mods = tmp / "mods"
    mods.mkdir()
    (mods / "cudainit_mod.py").write_text("import torch\ntorch.cuda.init()\n")
    (mods / "driverload_mod.py").write_text("import ctypes\nctypes.CDLL('libcuda.so.1')\n")
    script = tmp / "who.py"
    script.write_text("import json, os, sys\nprint(json.dumps({'pid': os.getpid(), 'ppid': os.getppid()}))\n")
    for mod in ("cudainit_mod", "driverload_mod"):
        env = _env(SLURMFT_WARM_IMPORTS=mod, PYTHONPATH=f"{mods}{os.pathsep}{_env()['PYTHONPATH']}")
        log = tmp / f"server-{mod}.log"
        proc, path, lock = _server(env, log)
        try:
            env[warmclient.SOCKET_ENV] = path
            client = subprocess.run(warm.worker_command([str(script)]), env=env, capture_output=True,
                                    text=True, timeout=_bound(100))
        finally:
            warmtask.stop_server(proc, path, lock)
        who = json.loads(client.stdout) if client.returncode == 0 and client.stdout.strip() else {}
        server_log = log.read_text()
        result[mod] = {"rc": client.returncode, "client_stderr": _tail(client.stderr, 5),
                       "ran_cold": who.get("ppid") != proc.pid and "starting this rank cold" in client.stderr,
                       "refused": "no warm workers on this node" in server_log,
                       "server_log": _tail(server_log, 5)}
    return result


RESTART_PHASES = (("launched", "main", "process"), ("main", "imports", "imports"), ("imports", "cuda", "cuda_context"),
                  ("cuda", "pg", "nccl_init"), ("pg", "model", "model_build"), ("model", "restored", "run_start_restore"),
                  ("restored", "first_step", "first_step"), ("first_step", "second_step", "second_step"),
                  ("launched", "first_step", "total_to_first_step"))


def _phases(marks: dict[str, Any]) -> dict[str, float | None]:
    def span(a: str, b: str) -> float | None:
        x, y = marks.get(a), marks.get(b)
        return None if x is None or y is None else round(y - x, 4)

    return {name: span(a, b) for a, b, name in RESTART_PHASES}


def _journaled_phases(run_dir: Path) -> list[dict[str, Any]]:
    """The ``restart_phases`` events the ranks journaled in ``run_dir``, in order."""
    from slurmft.journal import RESTART_PHASES as KIND, read_events
    from slurmft.rundir import RunDir

    keys = ("attempt", "tier", "import_s", "setup_s", "load_s", "first_step_s", "total_s")
    journal = RunDir(run_dir).events
    return [{k: e.get(k) for k in keys}
            for e in read_events(journal, [KIND])] if journal.exists() else []


def part_restart(out: Path, tmp: Path) -> dict[str, Any]:
    from slurmft.launch import warm, warmclient, warmtask

    run_dir = tmp / "restart-run"
    result: dict[str, Any] = {"base": _train([sys.executable, *_train_args(tmp / "base.json", 8, 4)],
                                             _rank_env(run_dir), tmp / "base.json", 90)}
    result["base"]["phases"] = _phases(result["base"].get("marks", {}))
    proc, path, lock = _server(_rank_env(run_dir), tmp / "server-restart.log")
    trials: list[dict[str, Any]] = []
    try:
        for i in range(RESTART_TRIALS):
            for kind in ("cold", "warm"):
                res = tmp / f"{kind}{i}.json"
                argv = _train_args(res, 0, 4, extra="2")
                env = _rank_env(run_dir)
                if kind == "warm":
                    env[warmclient.SOCKET_ENV] = path
                    command = warm.worker_command(argv)
                else:
                    command = [sys.executable, *argv]
                got = _train(command, env, res, 90)
                got["kind"] = kind
                got["forked_by_server"] = got.get("ppid") == proc.pid
                got["phases"] = _phases(got.get("marks", {}))
                trials.append({k: v for k, v in got.items() if k not in ("saves",)})
    finally:
        warmtask.stop_server(proc, path, lock)
    result["trials"] = trials
    result["server_log"] = _tail((tmp / "server-restart.log").read_text(), 10)
    result["journal_restart_phases"] = _journaled_phases(run_dir)
    medians: dict[str, dict[str, float | None]] = {}
    for kind in ("cold", "warm"):
        # A warm trial whose client ran the rank cold (the server refused) is no warm figure.
        rows = [t["phases"] for t in trials if t["kind"] == kind and t.get("rc") == 0
                and t.get("restored_step") is not None and (kind == "cold" or t["forked_by_server"])]
        medians[kind] = {name: (round(statistics.median(v), 4) if (v := [r[name] for r in rows
                                                                          if r.get(name) is not None]) else None)
                         for _, _, name in RESTART_PHASES}
    result["median_phases_s"] = medians
    return result


def part_inplace(out: Path, tmp: Path) -> dict[str, Any]:
    from slurmft.launch import agent, warm, warmclient, warmtask

    result: dict[str, Any] = {}
    for kind in ("warm", "cold"):
        run_dir, marker, res = tmp / f"inplace-{kind}", tmp / f"crash-{kind}", tmp / f"inplace-{kind}.json"
        rank = _train_args(res, 8, 4, crash_at="6", crash_marker=str(marker))
        env = _env(SLURMFT_RUN_DIR=str(run_dir), GPU_CHECK_T0=repr(time.time()))
        argv = [*agent.argv(), "--standalone", "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1",
                "--monitor-interval=0.5"]
        server = None
        if kind == "warm":
            server = _server(env, tmp / f"server-{kind}.log")
            env[warmclient.SOCKET_ENV] = server[1]
            argv += ["--no-python", *warm.worker_command(rank)]
        else:
            argv += rank
        try:
            rc, stderr = _run(argv, env, _bound(80))
        finally:
            if server is not None:
                warmtask.stop_server(*server)
        got: dict[str, Any] = {"rc": rc}
        attempts = [json.loads(f.read_text()) if f.exists() else None
                    for f in (res.with_suffix(f".{n}.json") for n in (0, 1))]
        crashed = float(marker.read_text()) if marker.exists() else None
        got["attempt0_restored"] = attempts[0] and attempts[0].get("restored_step")
        second = attempts[1] or {}
        got["attempt1"] = {k: second.get(k) for k in ("restored_step", "steps_run", "ppid", "error")}
        marks = {**second.get("marks", {}), "launched": crashed}
        spans = _phases(marks)
        got["crash_to"] = {name: spans[name] for name in
                           ("process", "imports", "cuda_context", "nccl_init", "model_build",
                            "run_start_restore", "first_step", "total_to_first_step")}
        got["forked_by_server"] = server is not None and second.get("ppid") == server[0].pid
        got["journal_restart_phases"] = _journaled_phases(run_dir)
        if rc != 0 or attempts[1] is None:
            got["stderr"] = _tail(stderr, 30)
        result[kind] = got
    return result


# ----------------------------------------------------------------------------- subprocess parts


_DEADLINE = [float("inf")]  # monotonic time by which every part must have ended (--budget-s)
_PART_DEADLINE = [float("inf")]  # ... and the running part (PART_TIMEOUT_S)


def _bound(seconds: float) -> float:
    """A step's own bound, cut to what is left of its part's and of the whole run's budget."""
    return max(5.0, min(seconds, _DEADLINE[0] - time.monotonic(), _PART_DEADLINE[0] - time.monotonic()))


def _sub_part(name: str, out: Path, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    result = tmp / f"{name}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--_part", name, "--_result", str(result),
            "--_tmp", str(tmp), "--size-gb", repr(args.size_gb)]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=_bound(PART_TIMEOUT_S[name]))
    got = json.loads(result.read_text()) if result.exists() else {}
    if proc.returncode != 0 or not result.exists():
        got.update(rc=proc.returncode, stderr=_tail(proc.stderr, 30))
    return got


def _inner(args: argparse.Namespace) -> None:
    """A subprocess part: runs with torch and CUDA, writes its JSON to --_result."""
    import torch

    import _gpu_dev as dev

    if not torch.cuda.is_available() and not dev.smoke():
        data: dict[str, Any] = {"skipped": f"torch {torch.__version__} sees no CUDA GPU"}
    elif args.part == "ckpt":
        import _gpu_ckpt

        def keep(partial: dict[str, Any]) -> None:
            Path(args.result).write_text(json.dumps(partial))

        data = _gpu_ckpt.run(args.size_gb, Path(args.tmp), keep)
    else:
        import _gpu_busy

        data = _gpu_busy.run()
    Path(args.result).write_text(json.dumps(data))


# ----------------------------------------------------------------------------- report


def _row(name: str, data: dict[str, Any]) -> str:
    if "skipped" in data:
        return f"{name:<6} skipped: {data['skipped']}"
    if "error" in data:
        return f"{name:<6} ERROR: {data['error']}"
    brief: Callable[[dict[str, Any]], str] = {
        "nvml": lambda d: (f"{len(d.get('facts', {}).get('devices', []))} GPU(s), driver "
                           f"{d.get('facts', {}).get('driver')}; checks: "
                           + ", ".join(f"{c['check']}={c['status']}" for c in d.get("gpu_checks_normal", []))
                           + f"; sweep CLI rc {d.get('sweep_cli', {}).get('rc')}"),
        "warm": lambda d: (f"forked rank rc {d.get('default_imports', {}).get('rc')}, forked="
                           f"{d.get('default_imports', {}).get('forked_by_server')}; refusals: "
                           + ", ".join(f"{m}: refused={d.get(m, {}).get('refused')} cold="
                                       f"{d.get(m, {}).get('ran_cold')}" for m in ("cudainit_mod", "driverload_mod"))),
        "nccl": lambda d: (f"rc {d['first'].get('rc')}/{d['resumed'].get('rc')}, report() "
                           f"{d['first'].get('report_us_median')} us/step, step "
                           f"{d['first'].get('step_ms_median')} ms; resumed at "
                           f"{d['resumed'].get('restored_step')}, mismatches "
                           f"{d['resumed'].get('restore_mismatches')}"),
        "restart": lambda d: "; ".join(
            f"{kind}: " + ", ".join(f"{k} {v}" for k, v in d["median_phases_s"][kind].items())
            for kind in ("cold", "warm")),
        "inplace": lambda d: "; ".join(
            f"{kind}: rc {d[kind].get('rc')}, resumed at {d[kind].get('attempt1', {}).get('restored_step')}, "
            f"crash to first step {d[kind].get('crash_to', {}).get('total_to_first_step')} s"
            for kind in ("warm", "cold")),
        "busy": lambda d: (f"busy/wall {d.get('with_timer', {}).get('busy_over_wall')}, enqueue "
                           f"{d.get('with_timer', {}).get('host_enqueue_s')} s vs "
                           f"{d.get('without_timer', {}).get('host_enqueue_s')} s"),
        "ckpt": lambda d: "; ".join([f"{k}: block {v.get('median_blocking_s', v.get('error'))} s, "
                                     f"total {v.get('median_total_s')} s"
                                     for k, v in d.get("methods", {}).items()]
                                    + [f"restore bit_equal={d.get('restore', {}).get('bit_equal')}"]),
    }[name]
    try:
        return f"{name:<6} {brief(data)}"
    except (KeyError, TypeError, AttributeError) as exc:
        return f"{name:<6} (incomplete: {exc}) {json.dumps(data)[:400]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="directory for the outputs (default: a temp dir)")
    p.add_argument("--size-gb", type=float, default=1.5, help="ckpt: GPU state (params + AdamW), GiB")
    p.add_argument("--only", default=",".join(PARTS), help=f"parts to run, of {','.join(PARTS)}")
    p.add_argument("--json", action="store_true")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="every part ends (killed if need be) within this many seconds of the start (480)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the GPU parts on the CPU (gloo): a dry run of this script, no GPU numbers")
    p.add_argument("--_part", dest="part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", dest="result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_tmp", dest="tmp", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        _inner(args)
        return 0
    parts = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in parts if s not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {unknown}; valid: {','.join(PARTS)}")
    for flag, value in (("--size-gb", args.size_gb), ("--budget-s", args.budget_s)):
        if not (math.isfinite(value) and value > 0):
            p.error(f"{flag} must be a number > 0, got {value:g}")
    _DEADLINE[0] = time.monotonic() + args.budget_s
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-out-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        os.environ["GPU_CHECK_CPU_SMOKE"] = "1"
        cuda, why = True, "CPU SMOKE RUN: the GPU parts ran on the CPU; no number here is a GPU's"
    else:
        cuda, why = _cuda_available()
    report: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "cuda": why,
                              "parts": {}}
    runners = {"nvml": part_nvml, "warm": part_warm, "nccl": part_nccl, "restart": part_restart,
               "inplace": part_inplace, "busy": lambda o, t: _sub_part("busy", o, t, args),
               "ckpt": lambda o, t: _sub_part("ckpt", o, t, args)}
    for name in parts:
        t0 = time.monotonic()
        data: dict[str, Any]
        if _DEADLINE[0] - time.monotonic() < 10:
            data = {"skipped": f"--budget-s {args.budget_s:g} spent before this part"}
        elif name != "nvml" and not cuda:
            data = {"skipped": f"needs a CUDA GPU: {why}"}
        else:
            _PART_DEADLINE[0] = time.monotonic() + PART_TIMEOUT_S[name]
            with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
                try:
                    data = runners[name](out, Path(tmp))
                except Exception as exc:  # noqa: BLE001 - one part's failure is its result
                    data = {"error": f"{type(exc).__name__}: {exc}"}
        data["part_s"] = round(time.monotonic() - t0, 2)
        report["parts"][name] = data
        print(_row(name, data), file=sys.stderr, flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True, default=str))
    else:
        for name, data in report["parts"].items():
            print(_row(name, data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
