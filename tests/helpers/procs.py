"""Process checks the tests share: whether a pid is still a live process (a zombie is not)."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """True while ``pid`` runs; False once it has ended (a zombie) or is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
