"""Whether a run directory named by a user (a job comment ``SLURMFT_RUN_DIR=...``) may be acted on.

The job comment is set by the job's user, so ``SLURMFT_RUN_DIR=/etc`` is as easy to write as a
real run dir. The watcher reads and writes a named directory only when :func:`trusted_run_dir`
accepts it for the job's user: an absolute, existing directory (its last component not a link),
owned by that user, that looks like a slurmft run dir. Torch-free, Slurm-free.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from slurmft.rundir import CHECKPOINTS, EVENTS, HEARTBEAT

_MARKS = (EVENTS, CHECKPOINTS, HEARTBEAT)


def trusted_run_dir(path: str | os.PathLike[str], owner_uid: int) -> Path:
    """The resolved run dir at ``path`` if the user ``owner_uid`` owns it; ValueError naming why not.

    Accepted: an absolute path to an existing directory whose last component is not a symbolic
    link, owned by ``owner_uid``, holding at least one of ``events.jsonl``, ``checkpoints/``,
    ``heartbeat/``. Links in the components above are resolved (a site's ``/scratch`` may be one);
    the directory that is returned is the resolved one, so a later re-pointing of a link above it
    changes nothing for the caller.
    """
    text = os.fspath(path)
    if not isinstance(text, str) or not text or "\0" in text:
        raise ValueError(f"run dir {text!r}: not a path")
    given = Path(text)
    if not given.is_absolute():
        raise ValueError(f"run dir {text!r}: not an absolute path")
    if isinstance(owner_uid, bool) or not isinstance(owner_uid, int) or owner_uid < 0:
        raise ValueError(f"owner uid {owner_uid!r}: not a user id")
    try:
        st = os.lstat(given)
    except FileNotFoundError:
        raise ValueError(f"run dir {text}: does not exist") from None
    except OSError as exc:
        raise ValueError(f"run dir {text}: cannot be examined ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"run dir {text}: a symbolic link; name the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"run dir {text}: not a directory")
    resolved = given.resolve(strict=True)
    st = os.lstat(resolved)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"run dir {text}: not a directory")
    if st.st_uid != owner_uid:
        raise ValueError(f"run dir {text}: owned by uid {st.st_uid}, not by the job's user (uid {owner_uid})")
    if not any(os.path.lexists(resolved / mark) for mark in _MARKS):
        raise ValueError(f"run dir {text}: not a slurmft run directory (none of {', '.join(_MARKS)} inside)")
    return resolved
