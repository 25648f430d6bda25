"""Self-requeue, and the job comment: the launcher's only Slurm calls besides ``srun``, made
through ``slurmft.slurm`` (bounded, retried, validated) when ``scontrol`` is on the PATH.

Without ``scontrol`` (a container image without the Slurm client) the launcher cannot requeue
itself: it journals ``requeue_request`` (reason, exclude: node names) and exits 85, and
``slurmft watch`` carries the request out. A failed Slurm call is journaled the same way: a
missing or failing client is never reported as "Slurm is ending this job".
"""

from __future__ import annotations

import shutil
from typing import Mapping

from slurmft import exitcodes, journal, steppoint
from slurmft.launch.identity import JobIdentity
from slurmft.launch.journaling import Voice
from slurmft.slurm.client import JobCancelled, JobState, SlurmError

from slurmft.slurm.parse_jobs import RUN_DIR_TOKEN  # the token the watcher reads

# The launcher's calls must end well before Slurm's KillWait after a preemption.
CLIENT_TIMEOUT_S = 10.0
CLIENT_RETRIES = 2


def slurm_client(env: Mapping[str, str]):  # -> CliSlurmClient | None
    """A client for this job's Slurm, or None when ``scontrol`` is not on the job's PATH."""
    if shutil.which("scontrol", path=env.get("PATH", "")) is None:
        return None
    from slurmft.slurm.cli import CliSlurmClient
    from slurmft.slurm.config import SlurmConfig

    return CliSlurmClient(SlurmConfig(timeout=CLIENT_TIMEOUT_S, retries=CLIENT_RETRIES,
                                      backoff=1.0, max_backoff=4.0), env=dict(env))


def publish_run_dir(client, identity: JobIdentity, run_dir: str, voice: Voice) -> None:
    """Put ``SLURMFT_RUN_DIR=<dir>`` in the job comment (kept beside any other comment text)."""
    token = f"{RUN_DIR_TOKEN}{run_dir}"
    if client is None:
        voice.log("no scontrol on PATH: the job comment is not set (submit with "
                  f"--comment={token} so slurmft watch finds the run)")
        return
    try:
        current = client.comment(identity.slurm_id)
        if token in current.split():
            return
        kept = " ".join(t for t in current.split() if not t.startswith(RUN_DIR_TOKEN))
        client.set_comment(identity.slurm_id, f"{kept} {token}".strip())
    except SlurmError as exc:
        voice.log(f"WARNING: could not set the job comment: {exc}")


def request(voice: Voice, reason: str, exclude: Mapping[str, str]) -> int:
    voice.event(journal.REQUEUE_REQUEST, reason=reason, exclude=sorted(exclude))
    voice.log(f"requeue requested from slurmft watch: {reason}"
              + (f" (exclude {','.join(sorted(exclude))})" if exclude else ""))
    return exitcodes.REQUEUE


def requeue_self(client, identity: JobIdentity, voice: Voice, reason: str,
                 exclude: Mapping[str, str] = {}) -> int:
    """Requeue this job (excluding ``exclude``) if Slurm still runs THIS run; return 85."""
    if client is None:
        return request(voice, f"{reason} (no scontrol in the job)", exclude)
    try:
        job = client.job(identity.slurm_id)
    except SlurmError as exc:
        return request(voice, f"{reason} (could not read the job: {exc})", exclude)
    if (job.state is not JobState.RUNNING or job.completing
            or job.restart_count != identity.restart_count):
        state = job.state.value + (" COMPLETING" if job.completing else "")
        voice.log(f"Slurm is ending this run (JobState={state}, restarts {job.restart_count}): "
                  "not requeueing it (its checkpoints are kept)")
        voice.template("not_requeued", state=state)
        return exitcodes.REQUEUE
    voice.template("requeue", reason=reason, exclude=",".join(sorted(exclude)))
    steppoint.reached("launch.requeue", identity.slurm_id)
    try:
        client.requeue(identity.slurm_id)
    except JobCancelled:  # cancelled since it was read: a cancel is final (slurm.policy)
        voice.log("the job was cancelled: not requeueing it (its checkpoints are kept)")
        voice.template("not_requeued", state=JobState.CANCELLED.value)
        return exitcodes.REQUEUE
    except SlurmError as exc:
        return request(voice, f"{reason} (scontrol requeue failed: {exc})", exclude)
    if exclude:
        try:
            client.update_pending(identity.slurm_id, exclude_nodes=sorted(exclude))
        except SlurmError as exc:
            return request(voice, f"{reason} (requeued, but ExcNodeList not set: {exc})", exclude)
    voice.log("requeued" + (f", excluding {','.join(sorted(exclude))}" if exclude else ""))
    return exitcodes.REQUEUE
