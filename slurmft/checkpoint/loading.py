"""Loading the newest valid checkpoint (``CheckpointManager.load_latest``, from :class:`CheckpointLoading`).

``load_latest`` tries committed checkpoints newest first: the manifest, presence and sizes are
checked first (no reads), then DCP loads it (resharding to the current world size) through
:class:`slurmft.checkpoint.verified_read.VerifyingReader`, which checksums every file in the same
single read and lets the ranks agree before anything is copied into the state. A checkpoint that
fails is skipped (and logged) by all ranks together, the state untouched, and the next older one
is tried. None left means a fresh start, logged. DCP's
``.metadata`` (a pickle) is only ever unpickled through the allow-list of
:mod:`slurmft.checkpoint.dcp_metadata`; one it refuses fails that checkpoint like a bad checksum.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from slurmft.rundir import RunDir
from slurmft.checkpoint.dcp_metadata import checked_metadata, parse_dcp_metadata, read_dcp_metadata_bytes
from slurmft.checkpoint.groups import CheckpointGroups
from slurmft.checkpoint.incremental import TensorIndex
from slurmft.checkpoint.local_tier import LocalTier, NewerFormatError
from slurmft.checkpoint.manifest import Manifest, ManifestVersionError, read_manifest
from slurmft.checkpoint.verify import verify_checkpoint
from slurmft.checkpoint.outcomes import CheckpointError, describe_failure
from slurmft.checkpoint.rng import reseed_for_new_world
from slurmft.checkpoint.state import RNG, TrainState
from slurmft.checkpoint.torch_compat import set_element
from slurmft.checkpoint.verified_read import CorruptCheckpoint, VerifyingReader
from slurmft.checkpoint.writer import LOAD_PHASE, FaultPlan

# The manager's log: these lines were always its own (filters and tests select them by this name).
log = logging.getLogger("slurmft.checkpoint.manager")


def _corruption(exc: BaseException) -> CorruptCheckpoint | None:
    """The agreed verification failure inside a DCP failure, if that is what it was."""
    if isinstance(exc, CorruptCheckpoint):
        return exc
    if isinstance(exc, CheckpointException):
        for failure, _tb in exc.failures.values():
            if isinstance(failure, CorruptCheckpoint):
                return failure
    return None


class _PlainDataLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor values are unpickled with ``weights_only=True``, and
    generator states the checkpoint does not have (CUDA's, after a CPU-only save) are not asked for."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            for rank_name, generators in state_dict.get(RNG, {}).items():
                for name in [n for n in generators
                             if f"{RNG}.{rank_name}.{n}" not in metadata.state_dict_metadata]:
                    del generators[name]
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class CheckpointLoading:
    """The loading half of :class:`slurmft.checkpoint.manager.CheckpointManager` (a base class of
    it): the attributes below are the manager's, set by its constructor."""

    run: RunDir
    load_skipped: list[tuple[int, str]]
    loaded_tier: str | None  # where the last load_latest read from: "local", "shared" or None
    _groups: CheckpointGroups
    _tier: LocalTier | None
    _faults: FaultPlan
    _tensors: TensorIndex | None
    _tmp_nonce: str
    _last_committed: int | None
    _last_shared: int | None
    wait: Callable[[], None]
    _watched: Callable[[str], contextlib.AbstractContextManager[None]]

    def load_latest(self, state: TrainState) -> int | None:
        """Restore the newest checkpoint that verifies; returns its step, or None (fresh start).

        Checkpoints that fail verification are logged and skipped, newest first. One written by a
        newer slurmft (a manifest format this one cannot read) is not damaged and must not be
        trained over: it raises :class:`CheckpointError` on every rank.
        """
        with self._watched("checkpoint load"):
            return self._load_latest(state)

    def _load_latest(self, state: TrainState) -> int | None:
        self.wait()
        self.load_skipped = []
        self.loaded_tier = None
        groups = self._groups
        if self.run.checkpoints.is_symlink():  # retention would refuse it too: never followed
            raise CheckpointError(f"{self.run.checkpoints}: a symbolic link; checkpoints must be a real "
                                  f"directory inside the run dir (point SLURMFT_RUN_DIR elsewhere instead)")
        steps = groups.broadcast(sorted(self.run.committed_steps(), reverse=True)
                                 if groups.is_coordinator else None)
        if self._tier is not None:
            return self._load_latest_tiered(state, steps)
        for step in steps:
            path = self.run.checkpoint(step)
            started = time.perf_counter()
            try:  # every rank reads the manifest, so every rank raises together
                report = verify_checkpoint(path, checksums=False)  # stat only; checksums below
            except ManifestVersionError as exc:
                raise CheckpointError(str(exc)) from None
            mine = list(report.problems)
            metadata = None
            if not mine and groups.is_coordinator:  # DCP's .metadata must unpickle through the
                metadata, refused = checked_metadata(path)   # allow-list (structure too), never freely
                mine += [refused] if refused else []
            problems = groups.union(mine)
            if not problems:
                problems = self._load(path, step, state, metadata=metadata)
            if problems:
                self.load_skipped.append((step, "; ".join(map(str, problems))))
                if groups.is_coordinator:
                    for problem in problems:
                        log.warning("checkpoint step %d skipped: %s", step, problem)
                continue
            self._last_committed = step
            self.loaded_tier = "shared"
            if self._tensors is not None:
                self._tensors.forget()  # what the last save wrote no longer describes the state
            if groups.is_coordinator:
                log.info("resumed from %s (verified while loading, one read, in %.2fs)", path,
                         time.perf_counter() - started)
            return step
        if groups.is_coordinator:
            log.info("no valid checkpoint under %s: fresh start", self.run.checkpoints)
        return None

    def _load_latest_tiered(self, state: TrainState, shared_steps: list[int]) -> int | None:
        """``load_latest`` with the node-local tier: the newest step any tier holds, first."""
        groups, tier = self._groups, self._tier
        assert tier is not None
        candidates, mine = tier.candidate_steps(shared_steps)
        nonce = self._tmp_nonce
        for step in candidates:
            started = time.perf_counter()
            roots = ([tier.checkpoint(step)] if step in mine else []) + \
                    ([self.run.checkpoint(step)] if step in shared_steps else [])
            try:
                files = tier.prepare_load(step, roots, functools.partial(self._template, state),
                                          self._files_read, nonce)
            except NewerFormatError as exc:
                raise CheckpointError(str(exc)) from None
            if files is None:
                self.load_skipped.append((step, "no rank can read its manifest in any tier"))
                if groups.is_coordinator:
                    log.warning("checkpoint step %d skipped: no rank can read its manifest in any tier", step)
                continue
            try:
                problems = files.problems
                if not problems:
                    where = next(r for r in files.roots if (r / ".metadata").is_file())
                    problems = self._load(where, step, state, files.manifest,
                                          tuple(r for r in files.roots if r != where))
                    read_from = "local" if where == tier.checkpoint(step) else "shared"
            finally:
                files.cleanup()
            if problems:
                self.load_skipped.append((step, "; ".join(map(str, problems))))
                if groups.is_coordinator:
                    for problem in problems:
                        log.warning("checkpoint step %d skipped: %s", step, problem)
                continue
            self.loaded_tier = read_from
            # A step loaded from the local tier only is not "committed" for this process: a save of
            # the same step (an emergency save right after the restart) writes and copies it again.
            self._last_committed = step if step in shared_steps else None
            if step in shared_steps:
                self._last_shared = step
            if groups.is_coordinator:
                log.info("resumed from step %d (%s; verified while loading, in %.2fs)", step,
                         "run directory" if step in shared_steps else "node-local tier",
                         time.perf_counter() - started)
            return step
        if groups.is_coordinator:
            log.info("no valid checkpoint in the run directory or the node-local tier: fresh start")
        return None

    def _template(self, state: TrainState, manifest: Manifest) -> dict[str, Any]:
        """The state dict a load of a checkpoint written by ``manifest.world_size`` ranks fills."""
        same_world = manifest.world_size == self._groups.world_size
        return {**state.heavy_state(), **state.light_state(include_rng=same_world)}

    def _files_read(self, where: Path, manifest: Manifest, template: dict[str, Any]) -> set[str]:
        """The files of the checkpoint at ``where`` that this rank's load of ``template`` reads:
        DCP's own load plan, against ``.metadata`` (unpickled through the allow-list)."""
        del manifest
        metadata = parse_dcp_metadata(read_dcp_metadata_bytes(where), where / ".metadata")
        planner = _PlainDataLoadPlanner()
        planner.set_up_planner(template, metadata, self._groups.is_coordinator)
        storage = metadata.storage_data or {}
        return {storage[item.storage_index].relative_path for item in planner.create_local_plan().items}

    def _load(self, path: Path, step: int, state: TrainState, manifest: Manifest | None = None,
              also: tuple[Path, ...] = (), metadata: Metadata | None = None) -> list[str]:
        """Load ``path`` into ``state``, checksumming as it reads; the problems that made every
        rank refuse it (state untouched), or [] once loaded. ``manifest`` (agreed, else the
        coordinator reads it) and ``also`` (more directories holding its files): the local tier.
        ``metadata``: its ``.metadata`` as this rank already checked it (the coordinator)."""
        self._faults.at(LOAD_PHASE, step)  # a test's slow storage ($SLURMFT_CKPT_FAULT_SLOW)
        groups = self._groups
        if manifest is None:
            manifest = groups.broadcast(read_manifest(path) if groups.is_coordinator else None)
        same_world = manifest.world_size == groups.world_size
        template = {**state.heavy_state(), **state.light_state(include_rng=same_world)}
        reader = VerifyingReader(path, manifest.every_file, rank=groups.rank, world_size=groups.world_size,
                                 union=groups.union, also=also, metadata=metadata)
        try:
            dcp.load(template, storage_reader=reader, planner=_PlainDataLoadPlanner(),
                     process_group=groups.io, no_dist=not groups.distributed)
        except (Exception, CheckpointException) as exc:
            corrupt = _corruption(exc)
            if corrupt is not None:
                return corrupt.problems
            raise CheckpointError(
                f"{path} verified but does not load into this state: {describe_failure(exc)}") from None
        try:
            state.load_state_dict(template)
        except Exception as exc:
            raise CheckpointError(
                f"{path} verified but does not load into this state: {describe_failure(exc)}") from None
        if state.step != step:
            raise CheckpointError(f"{path}: holds step {state.step}, its name says {step}")
        if not same_world:
            seed = reseed_for_new_world(step, self._groups.rank)
            log.info("world size changed %d -> %d: RNG reseeded from (step, rank), seed %d",
                     manifest.world_size, self._groups.world_size, seed)  # per rank: its own seed
        return []
