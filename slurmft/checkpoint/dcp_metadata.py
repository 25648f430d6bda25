"""Reading DCP's ``.metadata`` without trusting it: an allow-list unpickler and a DCP reader using it.

DCP stores a checkpoint's metadata as a pickle, and its ``FileSystemReader.read_metadata`` is a
plain ``pickle.load``: a ``.metadata`` written by the job's user would run any code in whoever
loads it (root's ``slurmft ckpt export``, the next job). The manifest's checksum does not help,
since the manifest sits in the same user-writable directory. Here the pickle may name only the
types DCP's metadata is made of (:data:`slurmft.checkpoint.pickle_scan.ALLOWED`, the table the
torch-free verification uses too; each is a plain record whose construction runs no user-chosen
code) and every other global is refused with an error naming
the file and the global. The file itself is read like every run-dir file: a regular file, no
link followed, at most ``MAX_METADATA_BYTES``.

:class:`SafeMetadataReader` is DCP's ``FileSystemReader`` with only ``read_metadata`` replaced
(public API: the ``StorageReader`` method, the reader's ``path`` and ``load_id`` attributes), so
``dcp.load`` never unpickles the file freely either.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, StorageMeta,
                                                   TensorStorageMetadata)

from slurmft.safeio import open_dir, read_regular
from slurmft.checkpoint.manifest import DCP_METADATA_NAME, MAX_METADATA_BYTES
from slurmft.checkpoint.pickle_scan import global_allowed

class MetadataRefused(ValueError):
    """``.metadata`` is not a DCP metadata pickle of allowed types; the message names the file."""


class _AllowListUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcodes can be guarded one by one) with an allow-list of
    globals; BUILD may set state on an instance, never on a class (that would rewrite an allowed
    type in this process)."""

    # typeshed leaves out the pure-Python unpickler's internals: its stack (set by load()), and a
    # dispatch table whose handlers take the _Unpickler (typeshed says Unpickler) they run in.
    stack: list[Any]
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, shown: str) -> None:
        super().__init__(io.BytesIO(data))
        self._shown = shown

    def _guarded_build(self) -> None:
        if isinstance(self.stack[-2], type):
            raise MetadataRefused(f"{self._shown}: refused to set state on the type {self.stack[-2].__name__}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # typeshed omits _Unpickler.load_build

    dispatch[pickle.BUILD[0]] = _guarded_build

    def find_class(self, module: str, name: str) -> Any:
        if global_allowed(module, name):
            found = super().find_class(module, name)
            if module != "torch" or name == "Size" or isinstance(found, torch.dtype):
                return found
        raise MetadataRefused(f"{self._shown}: refused to unpickle {module}.{name}: not a DCP metadata type")

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataRefused(f"{self._shown}: refused a persistent id: not a DCP metadata pickle")


def parse_dcp_metadata(data: bytes, shown: str | os.PathLike[str]) -> Metadata:
    """Unpickle ``.metadata`` bytes through the allow-list; :class:`MetadataRefused` otherwise."""
    shown = str(shown)
    try:
        metadata = _AllowListUnpickler(data, shown).load()
    except MetadataRefused:
        raise
    except RecursionError:
        raise MetadataRefused(f"{shown}: not a DCP metadata pickle (nested too deeply)") from None
    except Exception as exc:  # any malformed pickle: UnpicklingError, EOFError, TypeError, ...
        raise MetadataRefused(f"{shown}: not a DCP metadata pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise MetadataRefused(f"{shown}: holds a {type(metadata).__name__}, not DCP metadata")
    for key, value in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(value, (TensorStorageMetadata, BytesStorageMetadata)):
            raise MetadataRefused(f"{shown}: entry {key!r} is not a tensor or bytes description")
    return metadata


def read_dcp_metadata_bytes(ckpt_dir: Path, name: str = DCP_METADATA_NAME, *, dir_fd: int | None = None) -> bytes:
    """The bytes of ``<ckpt_dir>/<name>``: a regular file, no link followed, bounded. With ``dir_fd``
    (a descriptor of ``ckpt_dir``) the file is read there."""
    shown = Path(ckpt_dir) / name
    if dir_fd is not None:
        return read_regular(name, MAX_METADATA_BYTES, dir_fd=dir_fd, shown=shown)
    fd = open_dir(ckpt_dir)
    try:
        return read_regular(name, MAX_METADATA_BYTES, dir_fd=fd, shown=shown)
    finally:
        os.close(fd)


def load_dcp_metadata(ckpt_dir: Path) -> Metadata:
    """DCP's metadata of a checkpoint dir, read safely; OSError or :class:`MetadataRefused`."""
    return parse_dcp_metadata(read_dcp_metadata_bytes(ckpt_dir), Path(ckpt_dir) / DCP_METADATA_NAME)


def checked_metadata(ckpt_dir: Path) -> tuple[Metadata | None, str | None]:
    """The checkpoint's ``.metadata``, or why it cannot be used (one line)."""
    try:
        return load_dcp_metadata(ckpt_dir), None
    except MetadataRefused as exc:
        return None, str(exc)
    except OSError as exc:
        return None, (str(exc) if exc.filename
                      else f"{Path(ckpt_dir) / DCP_METADATA_NAME}: unreadable ({exc})")


def metadata_problem(ckpt_dir: Path) -> str | None:
    """Why the checkpoint's ``.metadata`` cannot be used (one line), or None when it can."""
    return checked_metadata(ckpt_dir)[1]


class SafeMetadataReader(FileSystemReader):
    """DCP's file-system reader whose ``read_metadata`` goes through the allow-list unpickler.

    ``dir_fd``: a descriptor of the checkpoint directory (kept open by the caller) to read from
    instead of looking ``path`` up again; ``path`` then only names the files in errors.
    ``metadata``: the ``.metadata`` the caller already read through :func:`checked_metadata` (a
    restore's coordinator checks it before the load: not unpickled twice).
    """

    def __init__(self, path: str | os.PathLike[str], *, dir_fd: int | None = None,
                 metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self.dir_fd = dir_fd
        self.checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA_NAME if rank is None else f"__{int(rank)}{DCP_METADATA_NAME}"
        ckpt_dir = Path(self.path)
        if rank is None and self.checked is not None:
            metadata = self.checked
        else:
            metadata = parse_dcp_metadata(read_dcp_metadata_bytes(ckpt_dir, name, dir_fd=self.dir_fd),
                                          ckpt_dir / name)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata
