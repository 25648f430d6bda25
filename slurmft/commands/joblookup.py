"""Looking up the job a command was given: one rule for what each failure means.

``find_job`` returns the job or raises ``LookupFailed`` with the exit code (2: no such job or
bad input; 4: Slurm could not be reached) and one line that names the job; each command prints
it with its own prefix.
"""

from __future__ import annotations

EXIT_USAGE, EXIT_SLURM = 2, 4


class LookupFailed(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def find_job(client, job_id: str):
    from slurmft.slurm.client import JobNotFound, SlurmError, SlurmUnavailable

    try:
        return client.job(job_id)
    except JobNotFound:
        raise LookupFailed(EXIT_USAGE, f"job {job_id} does not exist (neither the controller nor "
                           "accounting knows it)") from None
    except SlurmUnavailable as exc:
        raise LookupFailed(EXIT_SLURM, f"cannot reach Slurm to look up job {job_id}: {exc}") from None
    except SlurmError as exc:
        raise LookupFailed(EXIT_USAGE, f"job {job_id}: {exc}") from None
