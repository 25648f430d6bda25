"""Every Job/Node field the watcher relies on, and the Slurm behaviours that differ by release,
checked on whichever Slurm runs this file (``make test-matrix`` runs it on 22.05, 24.11, 26.05).

Fields are read through the client (``CliSlurmClient``): state and flags, reason, nodes, node
count and requested range, excluded nodes, restart count, exit code and signal, run dir, times.
Behaviours are Slurm's own (what ``scontrol requeue`` does to a finished job, who may update a
pending job...), so those probes run Slurm's commands directly and assert what the watcher and
the client count on. What a probe measures is also appended to ``$SLURMFT_MATRIX_REPORT`` when
set (one JSON line per feature); ``matrix/helper.py report`` turns those into the README's table.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import pytest

from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import Job, JobState, UnsupportedShape
from slurmft.slurm.devcluster import DevCluster
from slurmft.slurm.parse_jobs import parse_squeue
from slurmft.watch.config import WatchConfig

pytestmark = pytest.mark.integration

REPORT_ENV = "SLURMFT_MATRIX_REPORT"
# Slurm's own requeue delay: EligibleTime = requeue + ~121 s on every release measured.
REQUEUE_DELAY_S = (100, 140)
OWNER, OTHER = "nobody", "daemon"  # two unprivileged users every Debian rootfs has


def record(feature: str, value: object) -> None:
    """Append one measurement to the matrix report (one write: a torn line is all we risk)."""
    path = os.environ.get(REPORT_ENV)
    if path:
        line = json.dumps({"feature": feature, "value": str(value)}) + "\n"
        with open(path, "a") as fh:
            fh.write(line)


def now() -> datetime:
    return datetime.now(timezone.utc)


def slurm(cluster: DevCluster, *argv: str, user: str | None = None,
          timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """A Slurm command against ``cluster``, as root or as ``user``."""
    prefix = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user_group(user)}",
                                      "--clear-groups"]
    return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **cluster.env}, check=False)


def user_group(user: str) -> int:
    return pwd.getpwnam(user).pw_gid


def sbatch(cluster: DevCluster, *options: str, user: str | None = None) -> str:
    """Submit as ``user`` (the client submits as whoever runs it); return the job id."""
    proc = slurm(cluster, "sbatch", "--parsable", "--output=/dev/null", *options, user=user)
    assert proc.returncode == 0, f"sbatch {' '.join(options)}: {proc.stderr.strip()}"
    return proc.stdout.strip().split(";")[0]


def outcome(proc: subprocess.CompletedProcess[str]) -> str:
    """``ok`` or ``refused: <Slurm's first line>``, for the report."""
    if proc.returncode == 0:
        return "ok"
    first = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[:1]
    return f"refused (rc {proc.returncode}: {first[0] if first else 'no message'})"


def wait_job(client: CliSlurmClient, job_id: str, ok: Callable[[Job], bool], timeout: float,
             what: str) -> Job:
    deadline = time.monotonic() + timeout
    while True:
        job = client.job(job_id)
        if ok(job):
            return job
        if time.monotonic() >= deadline:
            raise AssertionError(f"job {job_id}: not {what} after {timeout:.0f} s: {job}\n"
                                 f"its output:\n{output_of(job_id)}")
        time.sleep(0.2)


def settled_pending(job: Job) -> bool:
    return job.state is JobState.PENDING and not job.completing


def finished(job: Job) -> bool:
    return job.state.finished and not job.completing


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / f"job-{abs(hash(body))}.sh"
    path.write_text(f"#!/bin/bash\n{body}\n")
    return path


# A job's output file (what its batch script and slurmstepd printed), by job id: a wait that runs
# out says what it held (a requeued "sleep 300" once ended FAILED, exit 1, the second it started,
# in a fresh-clone run on a loaded box, and /dev/null had kept why).
OUTPUTS: dict[str, Path] = {}


def submit(client: CliSlurmClient, tmp_path: Path, body: str, *options: str) -> str:
    job_id = client.submit(script(tmp_path, body),
                           sbatch_options=[f"--output={tmp_path}/job-%j.out", *options])
    OUTPUTS[job_id] = tmp_path / f"job-{job_id}.out"
    return job_id


def output_of(job_id: str) -> str:
    path = OUTPUTS.get(job_id)
    if path is None or not path.exists():
        return "(no output file)"
    return path.read_text(errors="replace")[-2000:] or "(empty output file)"


@pytest.fixture
def client(slurm_cluster: DevCluster) -> CliSlurmClient:
    return CliSlurmClient(env=slurm_cluster.env)


@pytest.mark.timeout(60)
def test_release_and_json_dialect(slurm_cluster, client):
    info = client.info()
    assert info.version[:2] == slurm_cluster.slurm_version[:2]
    record("slurm release", ".".join(f"{part:02d}" if i == 1 else str(part)
                                     for i, part in enumerate(info.version)))
    record("JSON data_parser used", info.data_parser or "none (no pins)")


@pytest.mark.timeout(180)
def test_job_fields_through_hold_run_requeue_and_restart(slurm_cluster, client, tmp_path):
    t0 = now().replace(microsecond=0)
    job_id = submit(client, tmp_path, "sleep 300", "--hold", "--nodes=2-3", "--exclude=n4",
                    "--job-name=fields", f"--comment=SLURMFT_RUN_DIR={tmp_path}/run")
    held = wait_job(client, job_id, settled_pending, 10, "PENDING")
    assert held.reason == "JobHeldUser"
    assert (held.min_nodes, held.max_nodes) == (2, 3)
    assert held.excluded_nodes == ("n4",)
    assert held.nodes == () and held.start_time is None and held.end_time is None
    assert held.restart_count == 0 and held.exit_code is None and held.exit_signal is None
    assert held.name == "fields" and held.run_dir == tmp_path / "run"
    assert t0 <= held.submit_time <= now()

    client.release(job_id)
    running = wait_job(client, job_id, lambda j: j.state is JobState.RUNNING, 20, "RUNNING")
    assert 2 <= running.node_count <= 3 and len(running.nodes) == running.node_count
    assert set(running.nodes) <= {"n1", "n2", "n3"}
    assert held.submit_time <= running.start_time <= now()
    assert running.end_time is None and running.exit_code is None
    record("nodes given to --nodes=2-3 (3 free)", running.node_count)

    t_requeue = now()
    assert client.requeue(job_id) is True
    first = wait_job(client, job_id, settled_pending, 30, "PENDING again")
    pending = wait_job(client, job_id, lambda j: settled_pending(j) and j.reason == "BeginTime",
                       20, "PENDING with reason BeginTime")
    delay = (pending.eligible_time - t_requeue).total_seconds()
    record("requeue: EligibleTime - requeue time (s)", round(delay))
    record("requeued job: first reason seen -> reason / flags",
           f"{first.reason or '(empty)'} -> {pending.reason} / {','.join(sorted(pending.flags)) or '-'}")
    assert REQUEUE_DELAY_S[0] <= delay <= REQUEUE_DELAY_S[1]
    assert pending.restart_count == 1
    # Slurm shows the allocated count as the range of a requeued job (3-3 here), yet still
    # schedules it on fewer nodes within the original request (checked below): the watcher
    # must not read min_nodes of a requeued job as "needs this many".
    record("requeued job that ran on 3 of --nodes=2-3: range shown",
           f"{pending.min_nodes}-{pending.max_nodes}")
    assert pending.max_nodes == 3 and pending.min_nodes in (2, 3)

    # As the watcher does (start_now_delay_s): a relaunch within about a second of the requeue
    # is refused by the node ("Job credential revoked") and the job FAILS (seen on 24.11 here,
    # started 0.84 s after the requeue).
    time.sleep(WatchConfig().start_now_delay_s)
    t_update = time.monotonic()
    client.update_pending(job_id, exclude_nodes=["n3"], start_now=True)
    # A generous bound (a loaded box): what matters is that it ran long before EligibleTime.
    again = wait_job(client, job_id, lambda j: j.state is JobState.RUNNING, 60, "RUNNING again")
    record("requeued -> RUNNING after StartTime=now (s)", f"{time.monotonic() - t_update:.1f}")
    assert (pending.eligible_time - again.start_time).total_seconds() > 30, "StartTime=now ignored"
    assert set(again.excluded_nodes) == {"n3", "n4"}, "ExcNodeList merged, not replaced"
    assert sorted(again.nodes) == ["n1", "n2"] and again.node_count == 2, "restarts on fewer nodes"
    assert again.restart_count == 1 and again.start_time >= pending.submit_time


@pytest.mark.timeout(90)
def test_exit_code_and_signal_from_controller_and_accounting(slurm_cluster, client, tmp_path):
    exited = submit(client, tmp_path, "exit 3")
    killed = submit(client, tmp_path, "kill -KILL $$")
    done = {j: wait_job(client, j, finished, 30, "finished") for j in (exited, killed)}
    assert done[exited].state is JobState.FAILED
    assert (done[exited].exit_code, done[exited].exit_signal) == (3, None)
    assert done[killed].state is JobState.FAILED
    assert (done[killed].exit_code, done[killed].exit_signal) == (None, 9)
    for job in done.values():
        assert job.start_time <= job.end_time <= now()
        assert job.nodes and job.restart_count == 0

    def accounted(job_id: str) -> Job:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # slurmctld hands records to slurmdbd asynchronously
            history = client.job_history(job_id)
            if history and history[-1].state.finished:
                return history[-1]
            time.sleep(0.5)
        raise AssertionError(f"job {job_id}: no finished accounting record after 30 s")

    assert (accounted(exited).exit_code, accounted(exited).exit_signal) == (3, None)
    assert accounted(killed).exit_signal == 9


@pytest.mark.timeout(90)
def test_requeue_of_finished_and_running_jobs(slurm_cluster, client, tmp_path):
    completed = submit(client, tmp_path, "true")
    failed = submit(client, tmp_path, "exit 3")
    for job_id in (completed, failed):
        wait_job(client, job_id, finished, 30, "finished")

    for job_id, label in ((completed, "COMPLETED"), (failed, "FAILED")):
        proc = slurm(slurm_cluster, "scontrol", "requeue", "Incomplete", job_id)
        job = client.job(job_id)
        record(f"`scontrol requeue Incomplete` on {label}",
               f"rc {proc.returncode}, job stays {job.state.value}"
               if job.state.value == label else f"rc {proc.returncode}, job -> {job.state.value}")
        assert job.state.value == label and job.restart_count == 0, "Incomplete left it alone"

    running = submit(client, tmp_path, "sleep 300")
    wait_job(client, running, lambda j: j.state is JobState.RUNNING, 20, "RUNNING")
    proc = slurm(slurm_cluster, "scontrol", "requeue", "Incomplete", running)
    job = wait_job(client, running, settled_pending, 30, "PENDING")
    record("`scontrol requeue Incomplete` on RUNNING", f"rc {proc.returncode}, job -> PENDING")
    assert proc.returncode == 0 and job.restart_count == 1

    # Why the client decides by state: a plain requeue brings a successful job back.
    proc = slurm(slurm_cluster, "scontrol", "requeue", completed)
    job = wait_job(client, completed, lambda j: not j.completing, 15, "settled")
    record("`scontrol requeue` on COMPLETED", f"rc {proc.returncode}, job -> {job.state.value}")
    assert proc.returncode == 0 and job.state is JobState.PENDING
    assert client.requeue(failed) is True  # FAILED: the client's plain requeue
    assert wait_job(client, failed, settled_pending, 30, "PENDING").restart_count == 1


@pytest.mark.timeout(60)
def test_a_future_shape_in_this_release_json_is_named(slurm_cluster, client, tmp_path):
    """This release's real ``squeue --json``, with one field turned into a shape no data_parser
    has had (a stand-in for the next one), fails with the field named, not a wrong value."""
    job_id = submit(client, tmp_path, "sleep 300", "--hold")
    flag = f"--json={client.info().data_parser}" if client.info().data_parser else "--json"
    proc = slurm(slurm_cluster, "squeue", flag)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    index = next(i for i, rec in enumerate(doc["jobs"]) if str(rec["job_id"]) == job_id)
    assert [j.job_id for j in parse_squeue(proc.stdout)].count(job_id) == 1

    doc["jobs"][index]["job_state"] = {"future": ["PENDING"]}
    with pytest.raises(UnsupportedShape, match=rf"jobs\[{index}\]\.job_state: expected"):
        parse_squeue(json.dumps(doc))
    del doc["jobs"][index]["job_state"]
    with pytest.raises(UnsupportedShape, match=rf"jobs\[{index}\]\.job_state"):
        parse_squeue(json.dumps(doc))


@pytest.mark.timeout(30)
def test_expedited_requeue_is_refused_where_not_enabled(slurm_cluster):
    proc = slurm(slurm_cluster, "sbatch", "--parsable", "--requeue=expedite", "--output=/dev/null",
                 "--wrap=true")
    record("`sbatch --requeue=expedite`, cluster without enable_expedited_requeue", outcome(proc))
    assert proc.returncode != 0 and not proc.stdout.strip(), "no job may be created"


# -- a second, small cluster of our own: readable by unprivileged users, knobs switched on --------


@pytest.fixture(scope="module")
def open_cluster() -> DevCluster:
    """A 2-node cluster whose directory unprivileged users can reach (pytest's temp root is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="slurmft-matrix-"))
    base.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    cluster = DevCluster.up(base / "cluster", nodes=2)
    try:
        yield cluster
    finally:
        if cluster.is_running():
            cluster.down()
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], timeout=60, check=False)


def add_conf_lines(cluster: DevCluster, lines: list[str]) -> None:
    conf = cluster.slurm_conf
    conf.write_text(conf.read_text() + "".join(f"{line}\n" for line in lines))
    proc = slurm(cluster, "scontrol", "reconfigure")
    assert proc.returncode == 0, f"scontrol reconfigure: {proc.stderr.strip()}"


@pytest.mark.timeout(120)
def test_job_owner_may_requeue_and_update_others_may_not(open_cluster):
    cluster = open_cluster
    cluster.reset()
    client = CliSlurmClient(env=cluster.env)
    job_id = sbatch(cluster, "--chdir=/tmp", "--wrap=sleep 300", user=OWNER)
    job = wait_job(client, job_id, lambda j: j.state is JobState.RUNNING, 20, "RUNNING")
    assert job.user == OWNER

    as_other = slurm(cluster, "scontrol", "requeue", job_id, user=OTHER)
    as_owner = slurm(cluster, "scontrol", "requeue", job_id, user=OWNER)
    record("requeue by another user / by the owner", f"{outcome(as_other)} / {outcome(as_owner)}")
    assert as_other.returncode != 0 and as_owner.returncode == 0
    wait_job(client, job_id, settled_pending, 30, "PENDING")

    update = ("scontrol", "update", f"JobId={job_id}", "ExcNodeList=n2", "StartTime=now")
    as_other = slurm(cluster, *update, user=OTHER)
    as_owner = slurm(cluster, *update, user=OWNER)
    record("pending job ExcNodeList+StartTime=now by another user / by the owner",
           f"{outcome(as_other)} / {outcome(as_owner)}")
    assert as_other.returncode != 0 and as_owner.returncode == 0
    job = wait_job(client, job_id, lambda j: j.state is JobState.RUNNING, 20, "RUNNING")
    assert job.nodes == ("n1",) and job.excluded_nodes == ("n2",)

    drain = slurm(cluster, "scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=x",
                  user=OWNER)
    record("drain a node as an unprivileged user", outcome(drain))
    assert drain.returncode != 0 and not client.nodes(["n2"])["n2"].drained


@pytest.mark.timeout(240)
def test_newer_requeue_knobs(open_cluster):
    """SchedulerParameters=requeue_delay=0 and SlurmctldParameters=enable_expedited_requeue:
    what each release makes of them (older ones ignore what they do not know)."""
    cluster = open_cluster
    cluster.reset()
    client = CliSlurmClient(env=cluster.env)
    add_conf_lines(cluster, ["SchedulerParameters=requeue_delay=0",
                             "SlurmctldParameters=enable_expedited_requeue"])

    job_id = sbatch(cluster, "--wrap=sleep 300")
    wait_job(client, job_id, lambda j: j.state is JobState.RUNNING, 20, "RUNNING")
    t_requeue, t0 = now(), time.monotonic()
    assert client.requeue(job_id) is True
    pending = wait_job(client, job_id, settled_pending, 30, "PENDING")
    delay = (pending.eligible_time - t_requeue).total_seconds()
    record("with requeue_delay=0: EligibleTime - requeue time (s)", round(delay))
    if delay < REQUEUE_DELAY_S[0]:
        # Eligible at once, started by the next scheduling pass (backfill: every 30 s by
        # default); the bound stays below the usual delay, so the knob is still proven.
        job = wait_job(client, job_id, lambda j: j.state is JobState.RUNNING, 90, "RUNNING")
        record("with requeue_delay=0: requeue -> RUNNING (s)", f"{time.monotonic() - t0:.1f}")
        assert job.restart_count == 1
    else:
        assert REQUEUE_DELAY_S[0] <= delay <= REQUEUE_DELAY_S[1]
    client.cancel(job_id)

    proc = slurm(cluster, "sbatch", "--parsable", "--requeue=expedite", "--output=/dev/null",
                 "--wrap=sleep 300")
    record("`sbatch --requeue=expedite` with enable_expedited_requeue", outcome(proc))
    if proc.returncode != 0:
        assert not proc.stdout.strip()
        return
    job_id = proc.stdout.strip().split(";")[0]
    wait_job(client, job_id, lambda j: j.state is JobState.RUNNING, 20, "RUNNING")
    t0 = time.monotonic()
    assert client.requeue(job_id) is True
    job = wait_job(client, job_id, lambda j: j.state is JobState.RUNNING and j.restart_count == 1,
                   30, "RUNNING again")
    record("expedited job: requeue -> RUNNING (s)", f"{time.monotonic() - t0:.1f}")
    assert job.restart_count == 1
