"""The node-local checkpoint tier: commit on the nodes' own disks, then copy to the run directory.

With ``[checkpoint] local_dir`` a save (:class:`slurmft.checkpoint.manager.CheckpointManager`) runs
in its background thread as:

1. ``dcp.save`` through ``CommitWriter`` into ``step_N.tmp-<id>`` of each node's local tier
   (:mod:`slurmft.checkpoint.tiers` says where): each rank writes its shards on its own node, the
   coordinator also ``.metadata`` and the manifest (every file of the checkpoint, checksummed);
2. :meth:`LocalTier.commit_local`: the manifest and ``.metadata`` go to every rank; with
   ``replicate`` each rank sends its shard files to a rank of the next node (nodes ordered by
   their lowest rank, wrapping around), which checks them against the manifest on arrival; once
   every rank's files are written, one rank per node writes ``.metadata`` and the manifest and
   renames its ``step_N.tmp-<id>`` to ``step_N``. The save is now durable on the local disks and
   losing any one node loses none of it;
3. :meth:`LocalTier.copy_to_shared`, when due (``shared_interval``): each rank copies its own
   files from its local ``step_N`` into ``step_N.tmp-<id>`` of the run directory, checksumming
   every byte against the manifest; the coordinator adds ``.metadata`` and the manifest and
   renames. The shared checkpoint is exactly what a save without the local tier commits.

Each node keeps its newest ``keep_local`` local checkpoints, and the coordinator records in the
run directory which node holds which step (``ckpt_tiers.json``, for ``slurmft ckpt ls``).

Loading (:meth:`LocalTier.prepare_load`) takes the newest step any tier holds. A node's local
``step_N`` holds only its own ranks' shards and a replica of one other node's, so before DCP reads
the ranks agree on the manifest, each rank plans which files its load will read (the state's own
load plan against ``.metadata``), and every file a rank needs but cannot reach on its node or in
the run directory is sent to it by a rank whose node holds it (:mod:`slurmft.checkpoint.tier_transfer`),
checked on arrival and kept in a per-rank fetch directory until the load is over. A step some
rank cannot complete this way is skipped by every rank, like a checkpoint that fails its checksums.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from slurmft.rundir import TMP_MARK, RunDir, atomic_write_bytes, fsync_dir, step_dirname
from slurmft.safeio import is_real_dir
from slurmft.checkpoint.checksum import StreamHasher
from slurmft.checkpoint.dcp_metadata import DCP_METADATA_NAME, read_dcp_metadata_bytes
from slurmft.checkpoint.manifest import (FileEntry, Manifest, ManifestError, ManifestVersionError,
                                    read_manifest, tmp_dirname, write_manifest)
from slurmft.checkpoint.retention import RetentionPolicy, apply_prune, plan_prune, scan_checkpoint_dirs
from slurmft.checkpoint.tier_transfer import Transfer, open_checkpoint_file, run_transfers
from slurmft.checkpoint.tiers import local_checkpoints, node_name, write_tier_index

log = logging.getLogger(__name__)

COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class NodeMap:
    """Which ranks share a node (and so a local disk): ``nodes[r]`` is rank r's node name."""

    nodes: tuple[str, ...]

    @property
    def order(self) -> list[str]:
        """Node names ordered by their lowest rank."""
        seen: list[str] = []
        for node in self.nodes:
            if node not in seen:
                seen.append(node)
        return seen

    def ranks_of(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def leader(self, rank: int) -> bool:
        """Whether ``rank`` is the lowest rank of its node (the one that commits its local dir)."""
        return self.nodes.index(self.nodes[rank]) == rank

    def replica_pairs(self) -> list[tuple[int, int]]:
        """(sender, receiver): each rank sends to a rank of the next node; none with one node."""
        order = self.order
        if len(order) < 2:
            return []
        pairs = []
        for i, node in enumerate(order):
            receivers = self.ranks_of(order[(i + 1) % len(order)])
            for j, rank in enumerate(self.ranks_of(node)):
                pairs.append((rank, receivers[j % len(receivers)]))
        return pairs


@dataclass
class LoadPlanFiles:
    """Where one rank's load of a step reads from: its roots in order, and the fetch dir to remove."""

    roots: list[Path]
    manifest: Manifest
    fetch_dir: Path | None = None
    problems: list[str] = field(default_factory=list)

    def cleanup(self) -> None:
        if self.fetch_dir is not None:
            shutil.rmtree(self.fetch_dir, ignore_errors=True)


class LocalTier:
    """One rank's view of the run's local tier. Construct on every rank together (one all-gather).

    ``groups``: the manager's :class:`slurmft.checkpoint.groups.CheckpointGroups`. ``faults``: the
    manager's fault plan (phase ``shared_copy`` pauses once a rank copied its files to the run directory, before the commit).
    """

    def __init__(self, run: RunDir, local_dir: str, *, groups: Any, keep_local: int, replicate: bool,
                 faults: Any, environ: dict[str, str] | None = None) -> None:
        self.run = run
        self.groups = groups
        self.node = node_name(environ)
        self.keep_local = keep_local
        self.replicate = replicate
        self.faults = faults
        problem, identity = None, None
        try:  # nothing may raise before the all-gather: the other ranks would wait there
            self.checkpoints = local_checkpoints(local_dir, run.root, self.node)
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            st = os.stat(self.checkpoints)
            identity = (st.st_dev, st.st_ino)
        except (OSError, ValueError) as exc:
            problem = f"[checkpoint] local_dir on node {self.node}: {exc}"
        seen = self._gather((self.node, identity, problem), groups.control)
        problems = [p for _n, _i, p in seen if p]
        nodes_of: dict[Any, set[str]] = {}
        for node, ident, _p in seen:
            if ident is not None:
                nodes_of.setdefault(ident, set()).add(node)
        shared = sorted(sorted(n) for n in nodes_of.values() if len(n) > 1)
        if shared:  # e.g. a shared filesystem without {node}: the nodes' commits would collide
            problems.append(f"[checkpoint] local_dir {local_dir!r} is one directory on nodes "
                            f"{', '.join(shared[0])}: it must be node-local or contain {{node}}")
        if problems:
            raise ValueError(problems[0])
        self.nodes = NodeMap(tuple(node for node, _i, _p in seen))

    # ------------------------------------------------------------------ collectives

    def _gather(self, obj: Any, group: Any) -> list[Any]:
        if not self.groups.distributed:
            return [obj]
        out: list[Any] = [None] * self.groups.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _broadcast(self, obj: Any, group: Any) -> Any:
        if not self.groups.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    # ------------------------------------------------------------------ saving

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_dirname(step)

    def commit_local(self, step: int, tmp_id: str, own: tuple[FileEntry, ...], manifest: Manifest | None
                     ) -> tuple[Manifest | None, bytes | None, list[str], list[str]]:
        """Step 2 of the save (every rank, save thread): the agreed manifest and ``.metadata``, the
        problems that kept some node from committing (none = committed on every node) and the
        replicas that were not kept (the same lists on every rank)."""
        io, rank = self.groups.io, self.groups.rank
        tmp = self.checkpoints / tmp_dirname(step, tmp_id)
        shared: tuple[Any, bytes | None] = (None, None)
        if self.groups.is_coordinator:
            try:
                shared = (manifest.to_json() if manifest else None, read_dcp_metadata_bytes(tmp))
            except OSError as exc:
                log.error("checkpoint step %d: cannot read back %s: %s", step, tmp / DCP_METADATA_NAME, exc)
        raw_manifest, metadata = self._broadcast(shared, io)
        if raw_manifest is None or metadata is None:  # every rank returns here, together
            return None, None, [f"checkpoint step {step}: the coordinator has no manifest or .metadata"], []
        agreed = Manifest.from_json(raw_manifest)
        owners = self._gather([e.path for e in own], io)
        entries = {e.path: e for e in agreed.files}
        transfers = []
        if self.replicate:
            transfers = [Transfer(src, dst, entries[name], tmp, tmp)
                         for src, dst in self.nodes.replica_pairs() for name in owners[src]]
        replica_problems = run_transfers(transfers, rank, io)
        # every rank's own files and received replicas are written
        replicas_missing = sorted(p for part in self._gather(replica_problems, io) for p in part)
        problems: list[str] = []
        if self.nodes.leader(rank):
            try:
                if not self.groups.is_coordinator:
                    atomic_write_bytes(tmp / DCP_METADATA_NAME, metadata)
                    write_manifest(tmp, agreed)
                fsync_dir(tmp)
                _rename_into_place(tmp, self.checkpoint(step), step)
                fsync_dir(self.checkpoints)
            except OSError as exc:
                problems.append(f"{self.node}: local commit of {tmp} failed: {exc}")
        problems = sorted(p for part in self._gather(problems, io) for p in part)
        return agreed, metadata, problems, replicas_missing

    def after_local_commit(self, step: int) -> None:
        """Prune this node's local tier (its leader) and record every node's steps (coordinator)."""
        held: list[int] | None = None
        if self.nodes.leader(self.groups.rank):
            try:
                committed, tmp_dirs = scan_checkpoint_dirs(self.checkpoints.parent)
                if step in committed:
                    plan = plan_prune(committed, step, tmp_dirs, RetentionPolicy(self.keep_local))
                    for path in apply_prune(self.checkpoints.parent, plan,
                                            lambda line: log.warning("local retention: %s", line)):
                        log.info("local retention removed %s", path)
                held = scan_checkpoint_dirs(self.checkpoints.parent)[0]
            except OSError as exc:
                log.error("local retention after step %d failed: %s", step, exc)
        by_rank = self._gather(held, self.groups.io)
        if self.groups.is_coordinator:
            record = {self.nodes.nodes[r]: steps for r, steps in enumerate(by_rank) if steps is not None}
            try:
                write_tier_index(self.run, record)
            except OSError as exc:
                log.warning("cannot record the local tiers in %s: %s", self.run.ckpt_tiers, exc)

    def copy_to_shared(self, step: int, tmp_id: str, own: tuple[FileEntry, ...], manifest: Manifest,
                       metadata: bytes) -> list[str]:
        """Step 3 of the save (every rank, save thread): the problems, none = committed in the run dir."""
        io = self.groups.io
        final = self.run.checkpoint(step)
        tmp = final.parent / tmp_dirname(step, tmp_id)
        entries = {e.path: e for e in manifest.files}
        problems: list[str] = []
        try:
            tmp.mkdir(exist_ok=True)
            if not is_real_dir(tmp):  # planted (a link) by someone who can write the run dir
                raise OSError(errno.ENOTDIR, "not a real directory; not written into", str(tmp))
            for entry in own:
                problems.extend(copy_verified(self.checkpoint(step), tmp, entries[entry.path]))
            fsync_dir(tmp)
        except OSError as exc:
            problems.append(f"{tmp}: {exc}")
        self.faults.at("shared_copy", step)  # a test's kill here: shards copied, nothing committed
        problems = sorted(p for part in self._gather(problems, io) for p in part)
        if not problems and self.groups.is_coordinator:
            try:
                atomic_write_bytes(tmp / DCP_METADATA_NAME, metadata)
                write_manifest(tmp, manifest)
                _rename_into_place(tmp, final, step)
                fsync_dir(final.parent)
            except OSError as exc:
                problems.append(f"commit of {final} failed: {exc}")
        return list(self._broadcast(problems, io))

    # ------------------------------------------------------------------ loading

    def local_steps(self) -> list[int]:
        """Committed steps in this node's local tier."""
        try:
            return scan_checkpoint_dirs(self.checkpoints.parent)[0]
        except OSError as exc:
            log.warning("local tier %s unreadable: %s", self.checkpoints, exc)
            return []

    def candidate_steps(self, shared_steps: list[int]) -> tuple[list[int], set[int]]:
        """Every step some tier holds, newest first, and the ones this node holds (control group)."""
        mine = set(self.local_steps())
        every = self._gather(sorted(mine), self.groups.control)
        return sorted(set(shared_steps).union(*map(set, every)), reverse=True), mine

    def prepare_load(self, step: int, roots: list[Path], template_for: Callable[[Manifest], Any],
                     plan_files: Callable[[Path, Manifest, Any], set[str]], nonce: str) -> LoadPlanFiles | None:
        """Agree on the manifest of ``step`` and bring every file this rank's load needs within
        reach (collective, control and io groups). ``roots``: where this rank finds the step (its
        node's local ``step_N``, the run dir's), in that order. ``template_for(manifest)``: the state
        dict the load fills (built on every rank, as it may take collectives); ``plan_files(dir,
        manifest, template)``: the files this rank's load reads, given a directory holding
        ``.metadata`` (local work only). None when no rank has a
        manifest; otherwise ``problems`` says why the step cannot load (every rank the same).

        Raises :class:`NewerFormatError` on every rank if any rank finds a newer format."""
        control, io, rank = self.groups.control, self.groups.io, self.groups.rank
        shared_root = self.run.checkpoint(step)
        found: list[Any] = []
        newer = None
        for root in roots:
            try:
                found.append(read_manifest(root).to_json())
            except ManifestVersionError as exc:
                newer = str(exc)
                found.append(None)
            except ManifestError:
                found.append(None)
        shared_copy = next((m for root, m in zip(roots, found) if root == shared_root and m), None)
        local_copy = next((m for root, m in zip(roots, found) if root != shared_root and m), None)
        gathered = self._gather((shared_copy, local_copy, newer), control)
        newer_anywhere = [n for _s, _l, n in gathered if n]
        if newer_anywhere:
            raise NewerFormatError(newer_anywhere[0])
        # The run directory's copy when any rank read one there (it is one file), else the
        # lowest rank's local one. A local copy that differs (a save of the same step that
        # a rollback replaced) is not read.
        chosen = next((s for s, _l, _n in gathered if s is not None),
                      next((loc for _s, loc, _n in gathered if loc is not None), None))
        if chosen is None:
            return None
        manifest = Manifest.from_json(chosen)
        template = template_for(manifest)
        mine = [root for root, m in zip(roots, found) if m == chosen]
        have = _files_present(mine, manifest)
        fetch_dir = self.checkpoints / tmp_dirname(step, f"fetch-r{rank}-{nonce}")
        result = LoadPlanFiles(mine + [fetch_dir], manifest, fetch_dir)
        entries = {e.path: e for e in manifest.files}
        everyone_has = self._gather(sorted(have), control)
        # .metadata first: a rank needs it to plan which shards it reads.
        problems = self._fetch([{DCP_METADATA_NAME} - set(h) for h in everyone_has], everyone_has,
                               entries, mine, fetch_dir, step, io)
        needed: set[str] = set()
        if not problems:
            where = next((d for d in result.roots if (d / DCP_METADATA_NAME).is_file()), None)
            try:
                if where is None:
                    raise FileNotFoundError(f"no {DCP_METADATA_NAME} reached")
                # Each node may read its own copy of .metadata: check it before DCP trusts it.
                problems = _matches(where, entries.get(DCP_METADATA_NAME))
                needed = set() if problems else plan_files(where, manifest, template)
            except Exception as exc:  # a refused or unplannable .metadata fails this step only
                needed = set()
                problems = [f"{shared_root}: cannot plan the load: {type(exc).__name__}: {exc}"]
        problems = sorted(p for part in self._gather(problems, control) for p in part)
        if problems:
            result.problems = problems
            return result
        missing = sorted(needed - have - {DCP_METADATA_NAME})
        wanted = self._gather(missing, control)
        result.problems = self._fetch([set(w) for w in wanted], everyone_has, entries, mine, fetch_dir, step, io)
        result.problems = sorted(p for part in self._gather(result.problems, control) for p in part)
        return result

    def _fetch(self, wanted: list[set[str]], everyone_has: list[list[str]], entries: dict[str, FileEntry],
               mine: list[Path], fetch_dir: Path, step: int, io: Any) -> list[str]:
        """Send each rank the files in ``wanted[rank]`` from the lowest rank holding them; the
        problems (the same list on every rank for files nobody holds)."""
        rank = self.groups.rank
        transfers: list[Transfer] = []
        problems: list[str] = []
        for dst, names in enumerate(wanted):
            for name in sorted(names):
                if name not in entries:
                    problems.append(f"step {step}: {name} is read by the load but not in the manifest")
                    continue
                holders = [r for r, h in enumerate(everyone_has) if name in h]
                if not holders:
                    problems.append(f"step {step}: {name} is in no tier any rank can reach")
                    continue
                src = holders[0]
                src_dir = next((d for d in mine if (d / name).is_file()), mine[0] if mine else fetch_dir) \
                    if src == rank else fetch_dir
                transfers.append(Transfer(src, dst, entries[name], src_dir, fetch_dir))
        if problems:
            return problems
        if any(t.dst == rank for t in transfers):
            try:
                fetch_dir.mkdir(parents=True, exist_ok=True)
            except OSError:
                pass  # every transfer still runs; the receiver names the file it could not write
        return run_transfers(transfers, rank, io)


class NewerFormatError(RuntimeError):
    """Some rank found the step's manifest in a format newer than this slurmft reads."""


def _matches(directory: Path, entry: FileEntry | None) -> list[str]:
    """[] when ``directory``'s ``.metadata`` has the manifest's size and checksum."""
    if entry is None:
        return [f"{directory}: the manifest lists no {DCP_METADATA_NAME}"]
    hasher = StreamHasher()
    hasher.update(read_dcp_metadata_bytes(directory))
    if hasher.size != entry.size or hasher.hexdigest() != entry.hash:
        return [f"{directory / DCP_METADATA_NAME}: does not match the manifest (checksum {hasher.hexdigest()})"]
    return []


def _files_present(roots: list[Path], manifest: Manifest) -> set[str]:
    """Manifest files found in ``roots`` as regular files of the listed size (no link followed)."""
    present = set()
    for entry in manifest.files:
        for root in roots:
            try:
                st = os.stat(root / entry.path, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size == entry.size:
                present.add(entry.path)
                break
    return present


def copy_verified(src_dir: Path, dst_dir: Path, entry: FileEntry) -> list[str]:
    """Copy one file, checksumming every byte against ``entry``; fsynced. The problems found."""
    hasher = StreamHasher()
    target = dst_dir / entry.path
    try:
        fd = open_checkpoint_file(src_dir, entry.path)
        with os.fdopen(fd, "rb", buffering=0) as src, open(target, "xb", buffering=0) as dst:
            buf = bytearray(COPY_CHUNK)
            view = memoryview(buf)
            while True:
                n = src.readinto(buf)
                if not n:
                    break
                hasher.update(view[:n])
                dst.write(view[:n])
            os.fsync(dst.fileno())
    except OSError as exc:
        return [f"copy of {src_dir / entry.path} to {target} failed: {exc.strerror or exc}"]
    if hasher.size != entry.size or hasher.hexdigest() != entry.hash:
        return [f"{src_dir / entry.path}: does not match the manifest (checksum {hasher.hexdigest()}); "
                f"not copied to the run directory"]
    return []


def _rename_into_place(tmp: Path, final: Path, step: int) -> None:
    """Rename ``tmp`` to ``final``; a checkpoint already there (a re-save after a rollback) is moved
    aside first, for retention to remove."""
    if final.exists():
        os.rename(final, final.parent / tmp_dirname(step, f"replaced-{tmp.name.split(TMP_MARK, 1)[-1]}"))
    os.rename(tmp, final)
