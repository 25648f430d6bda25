"""The ids of this process's gloo threads (tests check that closing a manager joined them)."""

from __future__ import annotations

import os


def gloo_threads() -> set[str]:
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().startswith(("pt_gloo", "gloo")):
                    found.add(tid)
        except FileNotFoundError:  # exited meanwhile
            pass
    return found
