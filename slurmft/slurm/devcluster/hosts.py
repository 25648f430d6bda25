"""The devcluster's marked block in /etc/hosts: node names (and, if needed, this machine's
hostname) mapped to 127.0.0.1, so srun/torchrun can use Slurm's node names as addresses.

Each cluster owns one block, keyed by its ClusterName and directory::

    # BEGIN slurmft-devcluster sftab12cd /tmp/x/.devcluster
    127.0.0.1 n1 n2 n3
    # END slurmft-devcluster sftab12cd

Two live clusters with the same node names each have their own block, so removing one block
leaves the names resolving for the other. A name the file already maps outside our blocks is
left to that line. Blocks whose directory no longer holds that cluster's state are stale (the
cluster was killed without ``down``) and are pruned by the next ``up``.

The file is rewritten in place under an exclusive flock on itself: /etc/hosts is often a bind
mount (containers), where renaming over it fails.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slurmft.slurm.devcluster.errors import DevClusterError

HOSTS_FILE = Path("/etc/hosts")
MARK = "slurmft-devcluster"
ADDRESS = "127.0.0.1"
_BEGIN = re.compile(rf"^# BEGIN {MARK} (\S+) (.+)$")
_END = re.compile(rf"^# END {MARK} (\S+)$")


@dataclass(frozen=True)
class Block:
    cluster: str
    directory: str
    names: tuple[str, ...]


def parse_blocks(text: str) -> tuple[list[str], list[Block]]:
    """Split hosts text into the lines outside our blocks and our blocks (an unterminated
    BEGIN is treated as ordinary text, so a hand-mangled file is never truncated)."""
    outside: list[str] = []
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        begin = _BEGIN.match(lines[i])
        end_at = None
        if begin:
            for j in range(i + 1, len(lines)):
                end = _END.match(lines[j])
                if end and end.group(1) == begin.group(1):
                    end_at = j
                    break
        if begin and end_at is not None:
            names: list[str] = []
            for line in lines[i + 1:end_at]:
                fields = line.split("#", 1)[0].split()
                names.extend(fields[1:])
            blocks.append(Block(begin.group(1), begin.group(2), tuple(names)))
            i = end_at + 1
        else:
            outside.append(lines[i])
            i += 1
    return outside, blocks


def names_mapped(lines: list[str]) -> set[str]:
    """Every host name an ordinary hosts line maps (comments ignored)."""
    found: set[str] = set()
    for line in lines:
        fields = line.split("#", 1)[0].split()
        found.update(fields[1:])
    return found


def render_block(block: Block) -> list[str]:
    return [f"# BEGIN {MARK} {block.cluster} {block.directory}",
            f"{ADDRESS} {' '.join(block.names)}",
            f"# END {MARK} {block.cluster}"]


def render(outside: list[str], blocks: list[Block]) -> str:
    lines = list(outside)
    for block in blocks:
        lines.extend(render_block(block))
    return "\n".join(lines) + "\n"


def with_block(text: str, cluster: str, directory: str, names: list[str],
               is_stale: Callable[[Block], bool] = lambda b: False) -> tuple[str, list[str]]:
    """Text with this cluster's block (replacing an older one of the same cluster) and with stale
    blocks pruned; returns the new text and the names the block maps. Names already mapped by an
    ordinary line stay with that line."""
    outside, blocks = parse_blocks(text)
    blocks = [b for b in blocks if b.cluster != cluster and not is_stale(b)]
    taken = names_mapped(outside)
    ours = [n for n in dict.fromkeys(names) if n not in taken]
    if ours:
        blocks.append(Block(cluster, directory, tuple(ours)))
    return render(outside, blocks), ours


def without_block(text: str, cluster: str) -> str:
    outside, blocks = parse_blocks(text)
    return render(outside, [b for b in blocks if b.cluster != cluster])


def _rewrite(path: Path, edit: Callable[[str], str]) -> None:
    """Apply ``edit`` to the file's text in place, holding an exclusive lock on it."""
    try:
        with open(path, "r+", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            old = fh.read()
            new = edit(old)
            if new != old:
                fh.seek(0)
                fh.write(new)
                fh.truncate()
                fh.flush()
                os.fsync(fh.fileno())
    except OSError as exc:
        raise DevClusterError(f"cannot edit {path}: {exc.strerror}") from None


def hostname_resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def add_cluster(cluster: str, directory: Path, names: list[str],
                is_stale: Callable[[Block], bool], path: Path = HOSTS_FILE) -> list[str]:
    """Install this cluster's block (plus this machine's hostname when it does not resolve);
    return the names the block maps."""
    own = socket.gethostname()
    result: list[str] = []

    def edit(text: str) -> str:
        wanted = list(names)
        # The hostname may resolve only thanks to another cluster's block, which its own
        # ``down`` will remove: then this block must map it too.
        _, blocks = parse_blocks(text)
        if own and (any(own in b.names for b in blocks) or not hostname_resolves(own)):
            wanted.append(own)
        new, ours = with_block(text, cluster, str(directory), wanted, is_stale)
        result.extend(ours)
        return new

    _rewrite(path, edit)
    return result


def remove_cluster(cluster: str, path: Path = HOSTS_FILE) -> None:
    _rewrite(path, lambda text: without_block(text, cluster))
