"""Which globals a pickle would load, found without unpickling it; the allow-list for DCP metadata.

DCP's ``.metadata`` is a pickle written by the job's user. :func:`metadata_pickle_problem` walks
its opcodes (``pickletools.genops``: nothing is constructed or called) and names the first global
that is not one of DCP's metadata types, or the first opcode that could reach code another way
(a persistent id, a copyreg extension, a global whose name is not a plain string). It is
torch-free, so ``slurmft ckpt verify``/``prune`` on a login node and the in-job verification
all call a checkpoint with such a ``.metadata`` invalid, and the same :data:`ALLOWED` table drives
the unpickler that actually loads it (:mod:`slurmft.checkpoint.dcp_metadata`).
"""

from __future__ import annotations

import pickletools
from typing import Any

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset({"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                              "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # layout name -> torch.layout, a table look-up
    "torch": frozenset({"Size"}),  # and the dtypes below
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # a checkpoint_id given as a Path
}
# torch.<dtype> as pickled by DCP (the canonical names and their aliases); the unpickler also
# checks that each really is a torch.dtype.
TORCH_DTYPES = frozenset(
    "float32 float float64 double float16 half bfloat16 complex32 chalf complex64 cfloat complex128 "
    "cdouble uint8 uint16 uint32 uint64 int8 int16 short int32 int int64 long bool quint8 qint8 "
    "qint32 quint4x2 quint2x4 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz "
    "float8_e8m0fnu float4_e2m1fn_x2 bits8 bits16 bits1x8 bits2x4 bits4x2 "
    "int1 int2 int3 int4 int5 int6 int7 uint1 uint2 uint3 uint4 uint5 uint6 uint7".split())

_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING",
                         "BINSTRING", "SHORT_BINSTRING"})
_NO_STACK_CHANGE = frozenset({"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})
_REFUSED_OPS = {"PERSID": "a persistent id", "BINPERSID": "a persistent id",
                "EXT1": "a copyreg extension", "EXT2": "a copyreg extension", "EXT4": "a copyreg extension"}
_UNKNOWN = object()


def global_allowed(module: str, name: str) -> bool:
    """Whether ``module.name`` is one of the types DCP's metadata is made of."""
    return name in ALLOWED.get(module, ()) or (module == "torch" and name in TORCH_DTYPES)


def pickle_globals(data: bytes) -> list[tuple[str, str]]:
    """Every global the pickle names, in order; ValueError for a malformed pickle, a global whose
    name is not a literal string, or an opcode in ``_REFUSED_OPS``."""
    memo: dict[Any, Any] = {}
    recent: list[Any] = []  # what the last stack-changing opcodes pushed (strings, or _UNKNOWN)
    found: list[tuple[str, str]] = []
    for op, arg, _pos in pickletools.genops(data):
        name = op.name
        if name in _REFUSED_OPS:
            raise ValueError(f"uses {_REFUSED_OPS[name]}")
        if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            memo[len(memo) if name == "MEMOIZE" else arg] = recent[-1] if recent else _UNKNOWN
            continue
        if name in _NO_STACK_CHANGE:
            continue
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            found.append((module, attr))
            recent.append(_UNKNOWN)
        elif name == "STACK_GLOBAL":
            pushed_module, pushed_attr = (recent[-2], recent[-1]) if len(recent) >= 2 else (_UNKNOWN, _UNKNOWN)
            if not (isinstance(pushed_module, str) and isinstance(pushed_attr, str)):
                raise ValueError("names a global that is not a plain string")
            found.append((pushed_module, pushed_attr))
            recent.append(_UNKNOWN)
        elif name in _STRING_OPS:
            recent.append(arg if isinstance(arg, str) else _UNKNOWN)
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            recent.append(memo.get(arg, _UNKNOWN))
        else:
            recent.append(_UNKNOWN)
        del recent[:-2]
    return found


def metadata_pickle_problem(data: bytes, shown: str) -> str | None:
    """One line naming why ``data`` is not a DCP metadata pickle of allowed types, or None."""
    try:
        names = pickle_globals(data)
    except RecursionError:
        return f"{shown}: not a pickle (nested too deeply)"
    except Exception as exc:  # genops raises ValueError, and others on truncated or odd bytes
        return f"{shown}: not a DCP metadata pickle ({' '.join(str(exc).split())[:200]})"
    for module, name in names:
        if not global_allowed(module, name):
            return f"{shown}: names {module}.{name}, not a DCP metadata type: refused (never unpickled)"
    return None
