"""A probe of the interpreter's teardown for a real process that the tests start: a
``sitecustomize`` (on the process's PYTHONPATH) which, only in a process whose command line is
``PYTHON -m MODULE`` for one of the given modules, keeps an object alive to the end whose
finalizer only the teardown runs (it writes ``<dir>/teardown``), and registers an ``atexit``
handler that leaves ``agent atexit ran`` in stdout's buffer (a pipe: block-buffered), which
must still come out."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable

ATEXIT_TEXT = "agent atexit ran"
_SITE = """
import atexit, os, sys
if sys.orig_argv[1:2] == ["-m"] and sys.orig_argv[2:3] and sys.orig_argv[2] in {modules!r}:
    class _Teardown:   # its globals and builtins may be gone when the teardown frees it
        def __del__(self, path=os.path.join({probe_dir!r}, "teardown"), open=open):
            with open(path, "w") as f:
                f.write("freed")
    probe = _Teardown()
    atexit.register(lambda: print({text!r}, end=""))
"""


def env(probe_dir: Path, modules: Iterable[str], base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the probe first on PYTHONPATH."""
    site = probe_dir / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE.format(modules=sorted(modules), probe_dir=str(probe_dir),
                                                        text=ATEXIT_TEXT))
    return {**(os.environ if base is None else base),
            "PYTHONPATH": os.pathsep.join([str(site), *sys.path[1:]])}


def tore_down(probe_dir: Path) -> bool:
    return (probe_dir / "teardown").exists()
