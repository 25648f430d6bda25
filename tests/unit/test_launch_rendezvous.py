"""Rendezvous from the environment only, the per-node task argv, and bounded children."""

import sys

import pytest

from launch_envs import recorded
from slurmft.launch import agent, identity, procs, rendezvous, settings, task
from slurmft.train import rdzv_poll

pytestmark = pytest.mark.timeout(60)
ENV = {**recorded("nonarray"), "SLURM_RESTART_COUNT": "4", "SLURMFT_RUN_DIR": "/runs/a",
       "SLURMFT_NPROC_PER_NODE": "2"}
IDENT = identity.from_environ(ENV)
CFG = settings.from_environ(ENV, IDENT)


def test_first_node_of_the_nodelist_hosts_the_store_with_an_id_per_restart():
    rdzv = rendezvous.choose(IDENT, {"n1": 40001, "n2": 40002})
    assert (rdzv.endpoint, rdzv.rdzv_id) == ("n1:40001", "slurmft-1-4")


def test_no_port_from_the_host_is_an_error_naming_it():
    with pytest.raises(rendezvous.RendezvousError, match="on n1 .* reported no free port"):
        rendezvous.choose(IDENT, {"n2": 40002})


def test_step_argv_runs_one_task_per_node_that_execs_torchrun():
    argv = rendezvous.step_argv(rendezvous.Rendezvous("n1", 40001, "r"), IDENT, CFG,
                                ["train.py", "--steps", "5"], python="/py")
    assert argv[:5] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    tail = argv[argv.index("slurmft.launch.task") + 1:]
    assert tail[:3] == ["/py", "-m", "slurmft.launch.agent"] == agent.argv("/py")
    assert "--nproc-per-node=2" in tail and "--rdzv-endpoint=n1:40001" in tail
    assert tail[-3:] == ["train.py", "--steps", "5"]


def test_the_step_env_makes_a_requeued_jobs_agents_poll_their_first_round_fast():
    """Every start of a requeued job forms a round: the agents poll it as in-allocation ones do
    (``rdzv_poll``: the value their hook accepts), on top of the launcher's environment, which
    is left as it was."""
    env = {"PATH": "/bin", rdzv_poll.ENV: "0.9"}
    step_env = rendezvous.step_env(env, IDENT)
    assert step_env[rdzv_poll.ENV] == str(rdzv_poll.poll_for(IDENT.num_nodes)) == "0.1"
    assert rdzv_poll.parse(step_env[rdzv_poll.ENV]) == rdzv_poll.POLL_S
    assert step_env["PATH"] == "/bin" and env[rdzv_poll.ENV] == "0.9"


@pytest.mark.parametrize("node_id, is_host", [("0", "1"), ("1", "0"), (None, "0")])
def test_only_node_zero_hosts_the_store(node_id, is_host):
    argv = task.argv_for_node(["/py", "-m", "slurmft.launch.agent", "--nnodes=2", "x.py"], node_id)
    assert argv == ["/py", "-m", "slurmft.launch.agent", f"--rdzv-conf=is_host={is_host}",
                    "--nnodes=2", "x.py"]


def test_a_child_past_its_bound_is_stopped_and_reported_as_such():
    rc, out = procs.run_bounded([sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"],
                                1.0)
    assert rc is None and "started" in out


def test_a_child_that_ignores_term_is_killed():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('x', flush=True); time.sleep(60)"
    proc = procs.start([sys.executable, "-c", code], capture=True)
    assert proc.stdout.readline() == b"x\n"
    procs.stop(proc, kill_after_s=0.5)
    assert proc.returncode == -9
