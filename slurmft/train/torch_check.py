"""The pre-flight's "does torch import on this node?", remembered on the node.

Importing torch is the slowest part of a node's pre-flight (2-3 s of CPU on an idle node, tens of
seconds on a busy one or with the venv on a network filesystem), and the pre-flight runs before
every start of the job: a requeue or an in-allocation restart on the same node paid it again,
seconds before torchrun and the ranks import torch themselves. A successful import is therefore
remembered in a node-local stamp named after what was imported: the interpreter, its version,
torch's ``__init__.py`` and ``lib/`` (path, size, mtime) and the node's boot id. Any change to the
install or a reboot names another stamp, and a stamp older than ``TTL_S`` is not trusted, so a
broken install is seen at the latest ``TTL_S`` after it broke (torchrun itself fails on such a
node in the meantime, which the watcher handles as a crash).

The stamp directory is this user's own (``/dev/shm/slurmft-<uid>``, else the temp dir), mode
0700; a directory or stamp that is a link, another user's, or writable by others is not trusted
(the import runs, nothing is remembered). A failed import removes the stamp. Torch-free until the
import itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
import sys
import tempfile
import time
from pathlib import Path

TTL_S = 6 * 3600.0
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def default_dir() -> Path:
    base = Path("/dev/shm")
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        base = Path(tempfile.gettempdir())
    return base / f"slurmft-{os.getuid()}"


def install_key() -> str | None:
    """What an import of torch would load, as a short hash; None when torch is not installed."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    init = Path(spec.origin)
    parts = [os.path.realpath(sys.executable), sys.version]
    for path in (init, init.parent / "lib"):
        try:
            st = os.stat(path)
        except OSError:
            return None
        parts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
    try:
        parts.append(BOOT_ID.read_text().strip())
    except OSError:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _own_private_dir(path: Path) -> bool:
    """``path`` exists (created here if missing) as this user's directory, not a link, 0700."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _fresh_stamp(path: Path, now: float) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()
            and 0 <= now - st.st_mtime <= TTL_S)


def _write_stamp(path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".torch-ok.", dir=path.parent)
    try:
        os.write(fd, f"{time.time():.0f}\n".encode())
        os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def check(stamp_dir: Path | None = None, now: float | None = None) -> str | None:
    """None when torch imports here (or did, per a trusted stamp); else the problem, one line."""
    key = install_key()
    folder = default_dir() if stamp_dir is None else stamp_dir
    trusted = key is not None and _own_private_dir(folder)
    stamp = folder / f"torch-ok-{key}"
    if trusted and _fresh_stamp(stamp, time.time() if now is None else now):
        return None
    try:
        import torch  # noqa: F401  (the check IS the import)
    except Exception as exc:  # a broken install raises anything, not only ImportError
        if trusted:
            try:
                stamp.unlink()
            except OSError:
                pass
        return f"cannot import torch: {type(exc).__name__}: {exc}"
    if trusted:
        _write_stamp(stamp)
    return None
