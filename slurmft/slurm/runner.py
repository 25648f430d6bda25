"""The ONE place Slurm commands are run: timeout, retries with backoff, error classification.

Every squeue/scontrol/sacct/sbatch/scancel call goes through :meth:`Runner.run` with an argv list
(never a shell), an environment overlay (``SLURM_CONF`` of a devcluster...) and a timeout.
Transient failures (our timeout, controller unreachable, socket timed out, slurmdbd connection
refused, the command killed by a signal not ours) are retried with exponential backoff
(tenacity); when they persist the call raises :class:`SlurmUnavailable` -- "could not observe",
never an empty result. Permanent failures raise the typed error at once, carrying Slurm's own
message. A call that changes state (``idempotent=False``: requeue, drain, update...) is retried
only when the controller could not be reached at all; a timeout, ours or Slurm's, or a signal
raises :class:`OutcomeUnknown` at once, and the caller re-reads the state to learn whether it
happened (``policy.change_confirmed``).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from slurmft.slurm.client import (
    InvalidArgument, JobNotFound, OutcomeUnknown, PermissionDenied, SlurmError, SlurmUnavailable,
)
from slurmft.slurm.config import SlurmConfig
from slurmft.subproc import run_bounded

# Slurm's messages when the controller/slurmdbd could not be reached: worth another try.
_UNREACHABLE = re.compile(
    r"Unable to contact slurm controller|Connection refused|connect failure|"
    r"slurm_persist_conn_open|Problem talking to the database|Slurm backup controller in standby|"
    r"Transport endpoint is not connected|Communication connection failure|"
    r"Resource temporarily unavailable",
    re.IGNORECASE,
)
# ... and when a request may or may not have reached it (not retried for non-idempotent calls).
_TIMED_OUT = re.compile(r"Socket timed out|Zero Bytes were transmitted|timed out", re.IGNORECASE)
_PERMANENT = (
    (re.compile(r"Invalid job id specified|Unknown job id|job id .* not found", re.IGNORECASE), JobNotFound),
    (re.compile(r"Invalid node name specified", re.IGNORECASE), InvalidArgument),
    (re.compile(r"Access/permission denied|Permission denied|Access denied|User not authorized|"
                r"Only the job owner", re.IGNORECASE), PermissionDenied),
)


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def message(self) -> str:
        """Slurm's own error text, one line."""
        lines = [l.strip() for l in self.stderr.splitlines() if l.strip()]
        return "; ".join(lines) or f"exit status {self.returncode}"


class _Transient(Exception):
    pass


def classify(result: Result) -> SlurmError:
    """The typed error for a failed command (never a transient one: see :func:`is_transient`)."""
    return classify_message(result.stderr, result.message, where=" ".join(result.argv[:2]))


def classify_message(text: str, message: str, *, where: str) -> SlurmError:
    """The typed error whose pattern matches Slurm's ``text``; ``message`` is what it says."""
    for pattern, cls in _PERMANENT:
        if pattern.search(text):
            return cls(f"{where}: {message}")
    return SlurmError(f"{where}: {message}")


def retrying(config: SlurmConfig, sleep: Callable[[float], None], transient: type[BaseException]) -> Retrying:
    """The retry policy of every Slurm call: ``config.retries`` more attempts, exponential backoff."""
    return Retrying(
        stop=stop_after_attempt(config.retries + 1),
        wait=wait_exponential(multiplier=config.backoff, max=config.max_backoff),
        retry=retry_if_exception_type(transient),
        sleep=sleep,
        reraise=True,
    )


def is_transient(stderr: str, *, idempotent: bool) -> bool:
    if _UNREACHABLE.search(stderr):
        return True
    return idempotent and bool(_TIMED_OUT.search(stderr))


def may_have_happened(stderr: str) -> bool:
    """Slurm's answer says the request may have reached the controller without an answer."""
    return bool(_TIMED_OUT.search(stderr)) and not _UNREACHABLE.search(stderr)


class Runner:
    """Runs Slurm commands for one client (one environment, one config)."""

    def __init__(self, config: SlurmConfig | None = None, env: Mapping[str, str] | None = None,
                 *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config or SlurmConfig()
        self.env_overlay = dict(env or {})
        self._sleep = sleep

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env_overlay)
        env.update(extra or {})
        return env

    def run(self, argv: Sequence[str], *, check: bool = True, idempotent: bool = True,
            timeout: float | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None) -> Result:
        """Run ``argv`` (in ``cwd``, default ours); retry transient failures; raise the typed
        error (``check``) or return."""
        argv = tuple(argv)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidArgument(f"argv must be a non-empty list of strings, got {argv!r}")
        limit = timeout or self.config.timeout
        environment = self.environment(env)
        try:
            return retrying(self.config, self._sleep, _Transient)(self._attempt, argv, limit, environment, check, idempotent, cwd)
        except _Transient as exc:
            raise SlurmUnavailable(
                f"could not observe: {' '.join(argv[:2])}: {exc} (after {self.config.retries + 1} attempts)"
            ) from None

    def _attempt(self, argv: tuple[str, ...], limit: float, env: dict[str, str], check: bool,
                 idempotent: bool, cwd: str | None = None) -> Result:
        try:
            proc = run_bounded(argv, limit, env=env, cwd=cwd)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]}: command not found (install slurm-wlm, or fix PATH)") from None
        if proc.returncode is None:  # killed after the timeout
            if not idempotent:
                raise OutcomeUnknown(
                    f"{' '.join(argv[:2])}: no answer within {limit:g} s; not retried (it may have "
                    "taken effect)"
                )
            raise _Transient(f"no answer within {limit:g} s")
        if proc.returncode < 0:
            # Killed by a signal that was not ours (ours is the timeout above): Slurm gave no
            # verdict. In a job this is the TERM that Slurm sends the batch step when the job is
            # requeued or cancelled; it reaches the commands the launcher is running right then.
            what = f"{' '.join(argv[:2])}: killed by signal {-proc.returncode}"
            if not idempotent:
                raise OutcomeUnknown(f"{what}; not retried (it may have taken effect)")
            raise _Transient(what)
        result = Result(argv, proc.returncode, proc.stdout.decode(errors="replace"),
                        proc.stderr.decode(errors="replace"))
        if proc.returncode != 0:
            if is_transient(result.stderr, idempotent=idempotent):
                raise _Transient(result.message)
            if not idempotent and may_have_happened(result.stderr):
                raise OutcomeUnknown(f"{' '.join(argv[:2])}: {result.message}; not retried (it may "
                                     "have taken effect)")
            if check:
                raise classify(result)
        return result
