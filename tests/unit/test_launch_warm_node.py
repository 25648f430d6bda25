"""Warm workers (slurmft.launch.warm, issue 27), the node's side: settings, the node step's argv,
the server's import configuration, real torch ranks forked from a server (a gloo world, a real
torchrun with a restart served by a node task) and their restart_phases. The client/server
mechanics are in test_launch_warm.py."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

import pytest
from test_launch_warm import PY, WAIT_S, Srv, _script, _start

from slurmft.launch import agent, warm, warmclient


# -- settings and the launch argv ---------------------------------------------------------------

@pytest.mark.parametrize("env, problem", [
    ({"SLURMFT_WARM_WORKERS": "yes"}, "SLURMFT_WARM_WORKERS='yes' must be 0 or 1"),
    ({"SLURMFT_WARM_WORKERS": "1", "SLURMFT_WARM_IMPORTS": "numpy,os;rm"}, "'os;rm' is not"),
])
def test_bad_settings_name_the_variable(env, problem):
    with pytest.raises(warm.WarmSettingsError, match=problem.replace("(", r"\(")):
        warm.settings(env)


def test_settings_default_and_extra_imports():
    assert warm.settings({}) == (None, warm.DEFAULT_IMPORTS)   # unset: the mode's default
    assert warm.settings({"SLURMFT_WARM_WORKERS": "0"})[0] is False
    assert warm.DEFAULT_IMPORTS[0] == "torch" and "slurmft.train.run" in warm.DEFAULT_IMPORTS
    assert warm.settings({"SLURMFT_WARM_WORKERS": "1", "SLURMFT_WARM_IMPORTS": " numpy, torch ,"}) \
        == (True, (*warm.DEFAULT_IMPORTS, "numpy"))


# -- torch: a real node server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_srv():
    server = Srv("torch,torch.distributed")
    yield server
    server.stop()


def test_two_warm_workers_form_a_gloo_world(torch_srv, tmp_path):
    script = _script(tmp_path, """
        import os, sys, torch, torch.distributed as dist
        assert "torch" in sys.modules
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(dist.get_world_size(), t.item(), torch.get_num_threads())
        dist.destroy_process_group()
    """)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_start(torch_srv, script, tmp_path, env=torch_srv.env(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
        WORLD_SIZE="2", OMP_NUM_THREADS="1")) for r in range(2)]
    outs = [p.communicate(timeout=WAIT_S) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split() == ["2", "3.0", "1"]   # OMP_NUM_THREADS of the rank, not the server's


def _four(**env: str):
    from launch_envs import recorded

    from slurmft.launch import alloc_settings, identity
    full = {**recorded("nonarray"), "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4",
            "SLURM_NNODES": "4", "SLURMFT_RUN_DIR": "/runs/a", **env}
    return alloc_settings.from_environ(full, identity.from_environ(full)), full


def test_warm_workers_are_on_by_default_in_both_modes_and_off_with_0():
    from slurmft.launch import identity, settings
    from slurmft.launch.settings import SettingsError

    def warm_on(**env: str) -> bool:
        alloc, full = _four(**env)
        return settings.from_environ(full, identity.from_environ(full)).warm_workers

    assert warm_on() is True and warm_on(SLURMFT_WARM_WORKERS="1") is True   # the requeue path
    assert warm_on(SLURMFT_WARM_WORKERS="0") is False
    assert warm_on(SLURMFT_SPARE_NODES="1") is True and warm_on(SLURMFT_IN_ALLOCATION="1") is True
    assert warm_on(SLURMFT_SPARE_NODES="1", SLURMFT_WARM_WORKERS="0") is False
    assert _four(SLURMFT_WARM_WORKERS="1")[0] is None   # it does not turn the mode on
    with pytest.raises(SettingsError, match="SLURMFT_WARM_WORKERS='yes' must be 0 or 1"):
        warm_on(SLURMFT_WARM_WORKERS="yes")
    with pytest.raises(SettingsError, match="SLURMFT_WARM_IMPORTS"):
        warm_on(SLURMFT_WARM_IMPORTS="a b")


def test_the_node_step_runs_the_client_after_no_python_only_when_on():
    from slurmft.launch import identity, nodesteps, rendezvous, settings
    from slurmft.launch.rendezvous import Rendezvous
    rdzv = Rendezvous("n1", 40001, "slurmft-1-0")
    command = ["-m", "pkg.train", "--x"]
    for on in ("0", "1"):
        alloc, full = _four(SLURMFT_SPARE_NODES="1", SLURMFT_WARM_WORKERS=on)
        ident = identity.from_environ(full)
        cfg = settings.from_environ(full, ident)
        in_alloc = nodesteps.node_argv("n2", rdzv, alloc, cfg, command, python="/py")
        requeue = rendezvous.step_argv(rdzv, ident, cfg, command, python="/py")
        for argv, last in ((in_alloc, f"--monitor-interval={nodesteps.MONITOR_S}"), (requeue, "--monitor-interval=1")):
            tail = argv[argv.index(last) + 1:]
            task_argv = argv[argv.index("slurmft.launch.task") + 1:]
            assert warm.serves(task_argv) is (on == "1")   # the node task asks for a server only then
            if on == "1":
                assert tail == ["--no-python", "/py", "-I", "-S", warmclient.__file__, "--", *command]
            else:
                assert tail == command


def test_a_node_task_serves_torchrun_restarts_from_its_warm_server(tmp_path, monkeypatch):
    """The node's whole chain for real: the task asks torchrun's agent for the server (forked
    from it: ``warmfork``), torchrun (standalone, two ranks, one restart) starts clients, the
    ranks are forked warm, form a gloo world, and the restart's ranks are forked again;
    torchrun's exit status comes back through the task."""
    from slurmft.launch import nodesteps, task
    from slurmft.rundir import RunDir
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, f"""
        import os, sys, torch, torch.distributed as dist
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        with open(os.path.join({str(out)!r}, f"{{attempt}}-{{dist.get_rank()}}"), "w") as f:
            server = open(f"/proc/{{os.getppid()}}/stat").read().rsplit(")", 1)[1].split()[1]
            agent = open(f"/proc/{{server}}/cmdline", "rb").read().split(b"\\0")
            comm = open(f"/proc/{{os.getppid()}}/comm").read().strip()
            f.write(f"{{os.getppid()}} {{t.item()}} {{comm == 'slurmft-warm'}} "
                    f"{{b'slurmft.launch.agent' in agent}}")
        dist.destroy_process_group()
        sys.exit(1 if attempt == 0 else 0)
    """)
    tmp = tempfile.mkdtemp(prefix="warm-task-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", tmp)
    monkeypatch.setenv("SLURMFT_WARM_WORKERS", "0")   # the argv decides, not the task's env
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    for name, value in nodesteps.STEP_ENV.items():   # as the launcher's steps (a restart needs it)
        monkeypatch.setenv(name, value)
    argv = [*agent.argv(PY), "--standalone", "--nproc-per-node=2",
            "--max-restarts=1", "--monitor-interval=0.2", "--no-python",
            *warm.worker_command([str(script)])]
    assert task.supervise(argv, RunDir(tmp_path).alive("n1")) == 0
    results = {p.name: p.read_text().split() for p in out.iterdir()}
    assert sorted(results) == ["0-0", "0-1", "1-0", "1-1"]
    servers = {ppid for ppid, *_ in results.values()}
    assert len(servers) == 1                       # every rank of both attempts: one warm server
    # ... forked from torchrun's agent (warmfork): torch imported once on the node
    assert all(rest == ["2.0", "True", "True"] for _, *rest in results.values())
    # the server stopped: its directory gone, and torchrun's log directory with its agent
    assert [n for n in os.listdir(tmp) if n.startswith(("slurmft-warm-", "slurmft-torch"))] == []
    shutil.rmtree(tmp)


def test_restart_phases_of_a_warm_worker_start_at_the_fork(monkeypatch):
    """slurmft.train.run imported by the server before the fork: the rank's imports were ready
    at its process start (import 0 s), and its set-up is not counted from the server's import."""
    from slurmft.train import phases
    now = time.time()
    monkeypatch.setattr(phases, "process_start_time", lambda: now - 2.0)
    marks = phases.RestartPhases(torch_imported=now - 300.0)
    fields = marks.event()
    assert fields["torch_imported"] == now - 2.0 and fields["import_s"] == 0.0
    assert 2.0 <= fields["setup_s"] < 300.0


def test_the_server_imports_fork_safely_configured(monkeypatch):
    """OpenBLAS without its thread pool, CUDA availability asked of NVML (no cuInit before a
    fork); a user's own values are kept (the ranks get their own environment anyway)."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    warm.prepare(["json"])
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    warm.prepare(["json"])
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
