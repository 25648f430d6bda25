"""Whether a process may still fork children that use CUDA: the warm server's CUDA check.

A process that initialised the CUDA driver (``cuInit``) cannot fork a child that uses CUDA. A
module may reach the driver without torch knowing (torch's own flag is not enough), so the server
also looks for the driver's library (``libcuda.so*``) in its memory map. On a real GPU node that
library is mapped after the default imports although nothing initialised it (2026-11-27, an H200
with torch 2.11+cu130, driver 580: ``benchmarks/gpu_check.py``), and refusing on that alone turned
warm workers off on every GPU node. So a mapped driver is asked, through the copy already loaded
(``RTLD_NOLOAD``: never a new one), whether it was initialised: ``cuDeviceGetCount`` answers
``CUDA_ERROR_NOT_INITIALIZED`` before ``cuInit`` and initialises nothing. Any other answer, a
library that cannot be asked (no such symbol, not loadable by its path) or a map that cannot be
read counts as initialised (fail closed: the ranks then start cold).
"""

from __future__ import annotations

import ctypes
import os
import re

CUDA_ERROR_NOT_INITIALIZED = 3

# The CUDA driver's library as the loader maps it (libcuda.so, libcuda.so.1, libcuda.so.550.54.15;
# not libcudart, the runtime, which a CUDA build of torch maps at import without touching a GPU).
_CUDA_DRIVER = re.compile(r"(^|/)libcuda\.so(\.[0-9.]+)?( \(deleted\))?$")


def cuda_driver_mapped(maps: str = "/proc/self/maps") -> str | None:
    """The path of a CUDA driver library mapped in this process, else None. A maps file that
    cannot be read counts (fail closed)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and _CUDA_DRIVER.search(fields[5]):
                    return fields[5]
    except OSError as exc:
        return f"(cannot read {maps}: {exc.strerror})"
    return None


def driver_initialised(path: str) -> str | None:
    """None when the driver library mapped at ``path`` says it was not initialised in this
    process, else why it was or may have been."""
    if not path.startswith("/") or path.endswith(" (deleted)"):
        return "it cannot be asked whether it was initialised"
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        get_count = lib.cuDeviceGetCount
    except (OSError, AttributeError) as exc:
        return f"it cannot be asked whether it was initialised ({exc})"
    get_count.argtypes = [ctypes.POINTER(ctypes.c_int)]
    get_count.restype = ctypes.c_int
    count = ctypes.c_int(-1)
    status = get_count(ctypes.byref(count))
    if status == CUDA_ERROR_NOT_INITIALIZED:
        return None
    return f"it was initialised (cuDeviceGetCount returned {status}, not CUDA_ERROR_NOT_INITIALIZED)"


def cuda_fork_problem(maps: str = "/proc/self/maps") -> str | None:
    """None when no CUDA driver in this process was initialised, else why forking is unsafe."""
    driver = cuda_driver_mapped(maps)
    if driver is None:
        return None
    why = driver_initialised(driver)
    if why is None:
        return None
    return f"the imports loaded the CUDA driver library {driver} and {why}: a forked worker could not use CUDA"
