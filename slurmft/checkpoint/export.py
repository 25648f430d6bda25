"""Read a committed checkpoint outside training: list its tensors, export its model as safetensors.

Used lazily by ``slurmft ckpt inspect --tensors`` and ``slurmft ckpt export`` (the only parts of
the CLI that import torch). Both work in one process with no process group, from a checkpoint
written by any number of ranks: DCP's ``.metadata`` records every tensor's global shape and the
chunks each rank wrote, and ``dcp.load`` assembles full tensors from them.

DCP's ``.metadata`` is a pickle written by the job's user, and this may run as root: it is read
once (a regular file, no link followed), its bytes checked against the manifest, and unpickled
only through the allow-list of :mod:`slurmft.checkpoint.dcp_metadata`; ``dcp.load`` reads it through
the same allow-list (:class:`SafeMetadataReader`). Every function takes ``dir_fd``, a descriptor
of the checkpoint directory that ``slurmft ckpt`` opened once below the run dir: everything is
then read there, and ``ckpt_dir`` only names files in errors.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from slurmft.rundir import fsync_dir
from slurmft.checkpoint.manager import describe_failure
from slurmft.checkpoint.checksum import StreamHasher
from slurmft.checkpoint.dcp_metadata import (MetadataRefused, parse_dcp_metadata,
                                        read_dcp_metadata_bytes)
from slurmft.checkpoint.manifest import DCP_METADATA_NAME, Manifest
from slurmft.checkpoint.verified_read import VerifyingReader
from slurmft.checkpoint.state import MODEL


class ExportError(Exception):
    """The checkpoint cannot be described or exported; the message names the file and the reason."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of DCP's metadata: a tensor (dtype, global shape, chunks) or pickled bytes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int | None
    chunks: int | None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
                "chunks": self.chunks}


@dataclass(frozen=True)
class ExportSummary:
    tensors: int
    nbytes: int


def read_dcp_metadata(ckpt_dir: Path, manifest: Manifest, *, dir_fd: int | None = None) -> Metadata:
    """DCP's metadata of a checkpoint, after checking ``.metadata`` against the manifest."""
    entry = next((f for f in manifest.files if f.path == DCP_METADATA_NAME), None)
    path = ckpt_dir / DCP_METADATA_NAME
    if entry is None:
        raise ExportError(f"{path}: not listed in the manifest")
    try:
        data = read_dcp_metadata_bytes(ckpt_dir, dir_fd=dir_fd)
    except OSError as exc:
        raise ExportError(str(exc) if exc.filename else f"{path}: unreadable ({exc.strerror})") from None
    hasher = StreamHasher()
    hasher.update(data)
    size, digest = len(data), hasher.hexdigest()
    if size != entry.size or digest != entry.hash:
        raise ExportError(f"{path}: does not match the manifest (size {size}, checksum {digest}); "
                          f"run 'slurmft ckpt verify'")
    try:
        return parse_dcp_metadata(data, path)
    except MetadataRefused as exc:
        raise ExportError(str(exc)) from None


def describe_checkpoint(ckpt_dir: Path, manifest: Manifest, *, dir_fd: int | None = None) -> list[TensorInfo]:
    """Every entry of the checkpoint's DCP metadata, sorted by key."""
    metadata = read_dcp_metadata(ckpt_dir, manifest, dir_fd=dir_fd)
    out = []
    for key, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            shape = tuple(meta.size)
            numel = 1
            for dim in shape:
                numel *= dim
            out.append(TensorInfo(key, str(dtype).removeprefix("torch."), shape,
                                  numel * dtype.itemsize, len(meta.chunks)))
        else:
            out.append(TensorInfo(key, "bytes", (), None, None))
    return out


def load_model_weights(ckpt_dir: Path, manifest: Manifest, *, dir_fd: int | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of a checkpoint, keyed by parameter/buffer name."""
    metadata = read_dcp_metadata(ckpt_dir, manifest, dir_fd=dir_fd)
    template: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        nested = (metadata.planner_data or {}).get(key)
        if not nested or nested[0] != MODEL or not isinstance(meta, TensorStorageMetadata):
            continue
        name = ".".join(str(part) for part in nested[1:])
        template[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not template:
        raise ExportError(f"{ckpt_dir}: no '{MODEL}' tensors in this checkpoint")
    try:
        with warnings.catch_warnings():  # "no process group: loading in a single process" is the point
            warnings.simplefilter("ignore", UserWarning)
            # The verifying reader: every file read is checksummed against the manifest in the same
            # read and opened without following a link (a file swapped since `verify` is caught).
            reader = VerifyingReader(ckpt_dir, manifest.every_file, rank=0, world_size=1, union=lambda xs: xs,
                                     dir_fd=dir_fd)
            dcp.load({MODEL: template}, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's wrapper is a BaseException
        raise ExportError(f"{ckpt_dir}: loading the model tensors failed: {describe_failure(exc)}") from None
    return template


def export_model_safetensors(ckpt_dir: Path, manifest: Manifest, out: Path, *,
                             dir_fd: int | None = None) -> ExportSummary:
    """Write the model weights to ``out`` (safetensors) atomically: temp file, fsync, rename."""
    from safetensors.torch import save_file

    weights = load_model_weights(ckpt_dir, manifest, dir_fd=dir_fd)
    header = {"format": "pt", "slurmft_step": str(manifest.step),
              "slurmft_world_size": str(manifest.world_size), "torch_version": manifest.torch_version}
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        save_file(weights, tmp, metadata=header)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
    return ExportSummary(len(weights), sum(t.numel() * t.element_size() for t in weights.values()))
