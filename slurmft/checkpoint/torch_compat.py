"""Every private torch API slurmft uses, each with a public fallback chosen once, at import.

Only torch 2.13 is tested (``pyproject.toml`` pins the ``train`` extra to it); these are the uses
a torch release may change without notice, in one place:

=========================================================  =====================================
private API (where)                                        public path used without it
=========================================================  =====================================
``torch._C.PyTorchFileWriter`` (shard_writer)              ``torch.save`` (with its zip CRC-32):
``torch.serialization._get_storage_alignment`` (same)      DCP's own ``FileSystemWriter.write_data``
``torch.serialization._save`` (same)                       writes the shard files, still hashed
``dcp.filesystem._StorageInfo`` (shard_writer,            through ``_HashingFileSystem`` streams;
incremental saves' references)                             every save is written whole
``dcp.filesystem._split_by_size_and_type`` (writer)
``torch.serialization._load`` with ``overall_storage``     ``torch.load`` of a copy of the bytes
(verified_read: a tensor that views the verified bytes)    (two more copies per tensor)
``torch.distributed._state_dict_utils._copy_state_dict``   a plain recursive ``copy_`` (below)
(staging)
``DTensor(local, spec)`` constructor and ``._spec``        ``DTensor.from_local`` on a CPU mesh;
(staging)                                                  DCP's ``BlockingAsyncStager`` otherwise
``DTensor._local_tensor`` (staging)                        ``DTensor.to_local()`` (always now)
``dcp._traverse.set_element`` (checkpoint)                 :func:`set_element` below (always now)
``distributed_c10d._world.pg_map`` (groups)                destroy, ignoring "not registered"
``Tensor._version`` (overlap: was a tensor changed          none: saves stage before returning
while its copy was in flight?)                             (``[checkpoint] overlap`` is ignored)
=========================================================  =====================================

A path is chosen when this module is imported: the private one when every name it needs exists
and a tiny probe through it works, else the public one (logged once). ``SLURMFT_TORCH_PUBLIC_ONLY=1``
forces every public path (the tests use it to prove each still round-trips a checkpoint).
"""

from __future__ import annotations

import ctypes
import io
import sys
import logging
import os
import pickle
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

PUBLIC_ONLY_ENV = "SLURMFT_TORCH_PUBLIC_ONLY"
PUBLIC_ONLY = os.environ.get(PUBLIC_ONLY_ENV, "") not in ("", "0")


def _probe(what: str, check: Callable[[], Any]) -> Any:
    """``check()``'s result, or None (logged once) when the private path is off or broken."""
    if PUBLIC_ONLY:
        return None
    try:
        return check()
    except Exception as exc:  # any change in a private API means: use the public path
        log.warning("torch %s: %s unavailable (%s: %s); using the public path",
                    torch.__version__, what, type(exc).__name__, exc)
        return None


# ----------------------------------------------------------------------------- shard files

def _fast_shard_write() -> tuple[Any, Any, Callable[[torch.Tensor, Any], None]]:
    from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo
    from torch.serialization import DEFAULT_PROTOCOL

    writer_cls, alignment, save = (torch._C.PyTorchFileWriter, torch.serialization._get_storage_alignment,
                                   torch.serialization._save)

    def save_without_crc(tensor: torch.Tensor, stream: Any) -> None:
        archive = writer_cls(stream, False, alignment())
        save(tensor, archive, pickle, DEFAULT_PROTOCOL, False)
        archive.write_end_of_file()

    probe = io.BytesIO()
    save_without_crc(torch.arange(4), probe)
    probe.seek(0)
    if not torch.equal(torch.load(probe, weights_only=True), torch.arange(4)):
        raise RuntimeError("a tensor written without CRC does not read back")
    return _StorageInfo, _split_by_size_and_type, save_without_crc


_FAST = _probe("the CRC-free shard writer (torch._C.PyTorchFileWriter, torch.serialization._save, "
               "DCP's _StorageInfo and _split_by_size_and_type)", _fast_shard_write)
# True: slurmft writes shard files itself; False: DCP's FileSystemWriter.write_data does.
FAST_SHARD_WRITE = _FAST is not None


def _fast() -> tuple[Any, Any, Callable[[torch.Tensor, Any], None]]:
    if _FAST is None:
        raise RuntimeError("the CRC-free shard writer is not available with this torch "
                           "(FAST_SHARD_WRITE is False: DCP writes the shards)")
    return _FAST


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """Where DCP's reader finds one record: DCP's own (private) ``_StorageInfo``."""
    return _fast()[0](relative_path=relative_path, offset=offset, length=length)


def split_by_size_and_type(bins: int, items: list[Any]) -> list[list[Any]]:
    """DCP's split of write items into ``bins`` files (the same files DCP itself would write)."""
    return _fast()[1](bins, items)


def save_tensor_without_crc(tensor: torch.Tensor, stream: Any) -> None:
    """``torch.save(tensor, stream)`` byte for byte, without the zip records' CRC-32."""
    _fast()[2](tensor, stream)


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over bytes already in memory, without copying them (``io.BytesIO``
    copies a bytearray or memoryview it is given)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def bytes_of(data: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU uint8 tensor, as a writable memoryview (no copy)."""
    if data.numel() == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * data.numel()).from_address(data.data_ptr())).cast("B")


def _load_public(data: torch.Tensor) -> torch.Tensor:
    return torch.load(io.BytesIO(bytes_of(data)), map_location="cpu", weights_only=True)


def _fast_load() -> Callable[[torch.Tensor], torch.Tensor]:
    reader_cls: Any = torch._C.PyTorchFileReader  # typed for real files; any file-like works
    load, unpickler = torch.serialization._load, torch.serialization._weights_only_unpickler

    def load_viewing(data: torch.Tensor) -> torch.Tensor:
        if bytes(bytes_of(data[:4])) != b"PK\x03\x04":  # not a zip archive: torch.load decides
            return _load_public(data)
        archive = reader_cls(_MemoryFile(bytes_of(data)))
        if archive.has_record("byteorder") and archive.get_record("byteorder") != sys.byteorder.encode():
            # torch byteswaps such an archive's storage in place: the verified bytes would
            # change under a second read item of the same range; the public path copies first
            return _load_public(data)
        start = data.storage_offset()  # bytes: uint8
        return load(archive, "cpu", unpickler, encoding="utf-8",  # as torch.load passes it
                    overall_storage=data.untyped_storage()[start:start + data.numel()])

    probe = io.BytesIO()
    torch.save(torch.arange(6).view(2, 3)[:, 1:], probe)
    data = torch.frombuffer(bytearray(b"x" + probe.getvalue()), dtype=torch.uint8)[1:]
    got = load_viewing(data)
    inside = data.data_ptr() <= got.untyped_storage().data_ptr() < data.data_ptr() + data.numel()
    if not torch.equal(got, torch.arange(6).view(2, 3)[:, 1:]) or not inside:
        raise RuntimeError("a tensor loaded in place does not read back")
    return load_viewing


_LOAD = _probe("torch.serialization._load over the verified bytes", _fast_load)


def load_tensor(data: torch.Tensor) -> torch.Tensor:
    """The tensor of one ``torch.save`` archive held in ``data`` (a contiguous CPU uint8 tensor).

    With the private path the tensor views ``data``'s memory (no copy: keep ``data`` unchanged
    while it is used); else ``torch.load`` of a copy. Always ``weights_only``.
    """
    return (_LOAD or _load_public)(data)


# ----------------------------------------------------------------------------- staging

@torch.no_grad()
def _copy_public(src: Any, dst: Any, non_blocking: bool) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(src, DTensor):
        dst.to_local().copy_(src.to_local(), non_blocking=non_blocking)
        return dst
    if isinstance(src, torch.Tensor):
        dst.copy_(src, non_blocking=non_blocking)
        return dst
    if isinstance(src, Mapping):
        return {key: _copy_public(value, dst[key], non_blocking) for key, value in src.items()}
    if isinstance(src, (list, tuple)):
        return type(src)(_copy_public(value, dst[i], non_blocking) for i, value in enumerate(src))
    return src


def _private_copy() -> Callable[..., Any]:
    from torch.distributed._state_dict_utils import _copy_state_dict

    return _copy_state_dict


_COPY = _probe("torch.distributed._state_dict_utils._copy_state_dict", _private_copy)


def copy_state_dict(src: dict[str, Any], dst: dict[str, Any], *, non_blocking: bool) -> dict[str, Any]:
    """Copy every tensor of ``src`` into the same place of ``dst`` (same structure); returns
    ``dst``'s structure with ``src``'s non-tensor values."""
    if _COPY is not None:
        return _COPY(src, dst, non_blocking=non_blocking)
    return _copy_public(src, dst, non_blocking)


def _private_dtensor_ctor() -> Callable[[Any, torch.Tensor], Any]:
    from torch.distributed.tensor import DTensor

    def wrap(like: Any, local: torch.Tensor) -> Any:
        return DTensor(local, like._spec, requires_grad=False)

    if not hasattr(DTensor, "_spec"):
        raise AttributeError("DTensor has no _spec")
    return wrap


_DTENSOR_CTOR = _probe("the DTensor(local, spec) constructor", _private_dtensor_ctor)


def host_dtensor_like(like: Any, local: torch.Tensor) -> Any | None:
    """A DTensor with ``like``'s mesh, placements and global shape around the host tensor ``local``
    (which must stay where it is), or None when only a move to the mesh's device is possible."""
    if _DTENSOR_CTOR is not None:
        return _DTENSOR_CTOR(like, local)
    if like.device_mesh.device_type != "cpu":
        return None  # from_local would move the buffer onto the device
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def public_stager() -> Any:
    """DCP's own public stager (pinned, cached host copies), for what ``host_dtensor_like`` cannot do."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager(cache_staged_state_dict=True)


# ----------------------------------------------------------------------------- load, groups

def set_element(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at the object ``path`` (str keys: dicts, int keys: lists) in ``root``,
    creating containers on the way: what DCP's planner does with a flattened key."""
    container: Any = root
    for key, next_key in zip(path, path[1:]):
        empty: Any = {} if isinstance(next_key, str) else []
        if isinstance(container, MutableMapping):
            container = container.setdefault(key, empty)
        else:
            while len(container) <= key:
                container.append(None)
            if container[key] is None:
                container[key] = empty
            container = container[key]
    last = path[-1]
    if isinstance(last, int) and not isinstance(container, Mapping):
        while len(container) <= last:
            container.append(None)
    container[last] = value


def _private_registry() -> Callable[[], Any]:
    from torch.distributed import distributed_c10d

    distributed_c10d._world.pg_map  # noqa: B018  (must exist)
    return lambda: distributed_c10d._world.pg_map


_REGISTRY = _probe("torch.distributed.distributed_c10d._world.pg_map", _private_registry)


def destroy_group(group: Any) -> None:
    """Destroy ``group`` unless a global ``destroy_process_group()`` already unregistered it (then
    dropping the last reference destroys it and joins its threads)."""
    if not dist.is_initialized():
        return
    if _REGISTRY is not None:
        if group in _REGISTRY():
            dist.destroy_process_group(group)
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": already unregistered
        pass


# ----------------------------------------------------------------------------- overlap

def _private_version() -> Callable[[torch.Tensor], int]:
    probe = torch.zeros(1)
    before = probe._version
    probe.add_(1)
    if not isinstance(before, int) or probe._version == before:
        raise AttributeError("Tensor._version does not count in-place changes")
    return lambda tensor: tensor._version


_VERSION = _probe("Tensor._version", _private_version)
# Overlapped staging is safe only when a change racing the copy can be seen.
VERSION_COUNTER = _VERSION is not None


def version_of(tensor: torch.Tensor) -> int:
    """The in-place change counter of ``tensor`` (shared with its views); 0 without it."""
    return _VERSION(tensor) if _VERSION is not None else 0


def private_paths() -> dict[str, bool]:
    """Which private paths are in use (False: the public fallback), for logs and tests."""
    return {"shard_write": FAST_SHARD_WRITE, "copy_state_dict": _COPY is not None,
            "dtensor_ctor": _DTENSOR_CTOR is not None, "group_registry": _REGISTRY is not None,
            "version_counter": VERSION_COUNTER, "load_in_place": _LOAD is not None}
