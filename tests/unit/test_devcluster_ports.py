"""Port choosing for devclusters: explicit base checked, automatic block free."""

from __future__ import annotations

import random
import socket

import pytest

from slurmft.slurm.devcluster.errors import DevClusterError
from slurmft.slurm.devcluster.ports import choose_ports, is_port_free, ports_from_base


def test_block_layout() -> None:
    ports = ports_from_base(30000, ["n1", "n2"])
    assert (ports.slurmctld, ports.slurmd_default, ports.slurmdbd, ports.mysql) == (30000, 30001, 30002, 30003)
    assert ports.nodes == {"n1": 30004, "n2": 30005}
    assert ports.all() == list(range(30000, 30006))


def test_taken_explicit_base_is_an_error_naming_the_port() -> None:
    # The block comes from below the ephemeral range: an ephemeral port's neighbours can be taken
    # by the suite's own outgoing connections, so the error would name more ports than ours.
    block = choose_ports(["n1"]).all()
    taken = block[2]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", taken))
        sock.listen()
        with pytest.raises(DevClusterError) as err:
            choose_ports(["n1"], base=block[0])
    message = str(err.value)
    assert message.startswith(f"--port-base {block[0]}: port(s) ")
    named = [int(p) for p in message.split("port(s) ", 1)[1].split(" on 127.0.0.1", 1)[0].split(", ")]
    assert taken in named
    assert set(named) <= set(block)
    assert f"already in use (this cluster needs {block[0]}-{block[-1]})" in message


@pytest.mark.parametrize("base", [80, 65533])
def test_explicit_base_out_of_range(base: int) -> None:
    with pytest.raises(DevClusterError, match="must lie within 1024-65535"):
        choose_ports(["n1", "n2"], base=base)


def test_automatic_block_is_free_and_skips_a_taken_port() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        taken = sock.getsockname()[1]
        assert not is_port_free(taken)
        ports = choose_ports(["n1", "n2", "n3"], rng=random.Random(7))
        assert taken not in ports.all()
        assert all(is_port_free(p) for p in ports.all())
