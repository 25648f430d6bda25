"""The devcluster's /etc/hosts block, edited on a temp file."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.slurm.devcluster import hosts
from slurmft.slurm.devcluster.hosts import Block, parse_blocks, with_block, without_block

BASE = "127.0.0.1 localhost\n::1 localhost ip6-localhost\n10.0.0.5 n3 # a real n3\n"


@pytest.fixture
def hosts_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "hosts"
    path.write_text(BASE)
    monkeypatch.setattr(hosts.socket, "gethostname", lambda: "box")
    monkeypatch.setattr(hosts, "hostname_resolves", lambda name: True)
    return path


def test_add_then_remove_restores_the_file(hosts_file: Path) -> None:
    added = hosts.add_cluster("sfta", Path("/d/a"), ["n1", "n2", "n3"], lambda b: False, hosts_file)
    assert added == ["n1", "n2"]  # n3 is already mapped by an ordinary line: left to it
    assert hosts_file.read_text() == BASE + (
        "# BEGIN slurmft-devcluster sfta /d/a\n127.0.0.1 n1 n2\n# END slurmft-devcluster sfta\n")
    hosts.remove_cluster("sfta", hosts_file)
    assert hosts_file.read_text() == BASE


def test_two_clusters_with_the_same_names_keep_them_until_both_are_gone(hosts_file: Path) -> None:
    hosts.add_cluster("sfta", Path("/d/a"), ["n1", "n2"], lambda b: False, hosts_file)
    hosts.add_cluster("sftb", Path("/d/b"), ["n1", "n2"], lambda b: False, hosts_file)
    hosts.remove_cluster("sfta", hosts_file)
    _, blocks = parse_blocks(hosts_file.read_text())
    assert blocks == [Block("sftb", "/d/b", ("n1", "n2"))]
    hosts.remove_cluster("sftb", hosts_file)
    assert hosts_file.read_text() == BASE


def test_stale_blocks_are_pruned_and_a_cluster_replaces_its_own_block() -> None:
    text, _ = with_block(BASE, "old", "/gone", ["n1"])
    text, _ = with_block(text, "sfta", "/d/a", ["n1"])
    text, ours = with_block(text, "sfta", "/d/a", ["n1", "n2"], is_stale=lambda b: b.cluster == "old")
    assert ours == ["n1", "n2"]
    assert [b.cluster for b in parse_blocks(text)[1]] == ["sfta"]


def test_unresolvable_hostname_is_mapped_too(hosts_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts, "hostname_resolves", lambda name: False)
    assert hosts.add_cluster("sfta", Path("/d/a"), ["n1"], lambda b: False, hosts_file) == ["n1", "box"]


def test_hostname_mapped_only_by_another_cluster_is_mapped_by_ours_too(hosts_file: Path) -> None:
    hosts_file.write_text(with_block(BASE, "sfta", "/d/a", ["n1", "box"])[0])
    assert hosts.add_cluster("sftb", Path("/d/b"), ["n1"], lambda b: False, hosts_file) == ["n1", "box"]
    hosts.remove_cluster("sfta", hosts_file)
    assert parse_blocks(hosts_file.read_text())[1] == [Block("sftb", "/d/b", ("n1", "box"))]


def test_unterminated_block_is_kept_as_ordinary_text() -> None:
    text = BASE + "# BEGIN slurmft-devcluster sfta /d/a\n127.0.0.1 n1\n"
    assert without_block(text, "sfta") == text


def test_a_cluster_whose_up_is_under_way_is_not_stale(tmp_path: Path) -> None:
    """Between ``up`` saving its state (no daemon yet) and its first daemon, another cluster's
    ``up`` pruned its block as stale (parallel test workers lost /etc/hosts blocks): a directory
    whose lock is held is being started, not dead."""
    from slurmft.slurm.devcluster.cluster import _block_is_stale
    from slurmft.slurm.devcluster.dirlock import dir_lock
    from slurmft.slurm.devcluster.layout import ClusterState, Layout
    from slurmft.slurm.devcluster.ports import ports_from_base

    layout = Layout(tmp_path / "dc")
    block = Block("sftstart", str(layout.root), ("n1",))
    with dir_lock(layout):
        ClusterState(cluster_name="sftstart", node_names=["n1"], ports=ports_from_base(20000, ["n1"]),
                     slurm_version=(22, 5, 8)).save(layout)
        assert not _block_is_stale(block)
    assert _block_is_stale(block)  # lock released and still no daemon: a dead cluster's block
