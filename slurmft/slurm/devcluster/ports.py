"""Choosing TCP ports on 127.0.0.1 for one devcluster, so that several clusters can coexist.

A port is free when a fresh socket can bind it on 127.0.0.1 (without SO_REUSEADDR, so a port in
TIME_WAIT counts as taken: the daemon would fail on it too). A cluster takes one contiguous block:
slurmctld, the default SlurmdPort, slurmdbd, MariaDB, then one port per node.
"""

from __future__ import annotations

import random
import socket

from slurmft.slurm.devcluster.errors import DevClusterError
from slurmft.slurm.devcluster.layout import Ports

FIXED_PORTS = 4  # slurmctld, default SlurmdPort, slurmdbd, mysql
# Below Linux's default ephemeral range (32768-60999), so outgoing connections never squat on it.
AUTO_RANGE = (20000, 32000)
AUTO_TRIES = 200


def block_size(nodes: int) -> int:
    return FIXED_PORTS + nodes


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def ports_from_base(base: int, node_names: list[str]) -> Ports:
    """The port assignment of a block starting at ``base`` (pure)."""
    return Ports(slurmctld=base, slurmd_default=base + 1, slurmdbd=base + 2, mysql=base + 3,
                 nodes={name: base + FIXED_PORTS + i for i, name in enumerate(node_names)})


def check_base(base: int, nodes: int) -> None:
    """Validate an explicit --port-base (range only; whether it is free is checked separately)."""
    last = base + block_size(nodes) - 1
    if base < 1024 or last > 65535:
        raise DevClusterError(
            f"--port-base {base}: the block {base}-{last} must lie within 1024-65535")


def choose_ports(node_names: list[str], base: int | None = None,
                 rng: random.Random | None = None) -> Ports:
    """An explicit ``base`` whose block is entirely free, else a random free block in AUTO_RANGE."""
    size = block_size(len(node_names))
    if base is not None:
        check_base(base, len(node_names))
        taken = [p for p in range(base, base + size) if not is_port_free(p)]
        if taken:
            raise DevClusterError(
                f"--port-base {base}: port(s) {', '.join(map(str, taken))} on 127.0.0.1 already "
                f"in use (this cluster needs {base}-{base + size - 1})")
        return ports_from_base(base, node_names)
    rng = rng or random.Random()
    low, high = AUTO_RANGE
    for _ in range(AUTO_TRIES):
        start = rng.randrange(low, high - size)
        if all(is_port_free(p) for p in range(start, start + size)):
            return ports_from_base(start, node_names)
    raise DevClusterError(
        f"found no {size} consecutive free ports on 127.0.0.1 in {low}-{high}; pass --port-base")
