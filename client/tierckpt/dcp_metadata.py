"""Safe decoding of DCP's `.metadata`: an allow-list unpickler, then a shape check.

`.metadata` is a pickle (DCP's format), and its bytes come from ranks, peers and buckets,
none of which the daemon or a training process may trust: ``pickle.loads`` on it runs
whatever ``__reduce__`` the writer chose. `load_metadata` resolves only the globals a
real DCP `.metadata` refers to (`_ALLOWED`, each entry with its reason): DCP's metadata
dataclasses, the legacy sharded-tensor ``TensorProperties`` older checkpoints carry,
``torch.Size``, dtypes and layouts, ``pathlib`` paths (``storage_meta``'s checkpoint id)
and a few builtin containers. Every one of them is inert to construct. No callable that
reaches the filesystem, the interpreter or torch storages is admitted.

The list was read from DCP's own types, not found by trial: what ``FileSystemWriter``
(and ``FsspecWriter``, which shares it) pickles into `.metadata` is one `Metadata`
whose fields hold only the classes of ``torch.distributed.checkpoint.metadata``,
``filesystem._StorageInfo`` and what those classes' fields and ``__getstate__`` hold.
Checked against torch 2.13.0 (installed) and torch's published sources of 2.6 (same
classes; 2.7 added ``Metadata.version``, 2.8 ``_StorageInfo.transform_descriptors``:
fields, no new class) and of 2.1, whose DCP imported ``TensorProperties`` from
``torch.distributed._shard.sharded_tensor.metadata``: a checkpoint it wrote names that
class and its ``MEM_FORMAT_ENCODING``, and DCP still loads it (torch's
``test_compatibility.py::test_sharded_tensor_dependency``). Deliberately not admitted:
``ShardMetadata`` / ``ShardedTensorMetadata`` (``torch.distributed._shard``), which DCP
never writes (it turns a ShardedTensor into `ChunkStorageMetadata` chunks) and whose
placement builds a ``_remote_device``; the planner's ``WriteItem``/``SavePlan`` and
``storage.WriteResult``, exchanged between ranks but never stored in `.metadata`.

What the allow-list alone would not stop:

- Algorithmic bombs (audit 3, H1): a 170-byte pickle of a memoized nested tuple that
  expands to 2^30 leaves when hashed, ``bytearray(512 MiB)`` from 68 bytes. Before any
  object is built, `tierckpt.pickle_scan.scan` walks the opcodes and bounds the work and
  memory: at most `MAX_METADATA_BYTES` of input, nesting at most
  `tierckpt.pickle_scan.MAX_DEPTH` deep, a logical object count (a memo GET of a
  container counts its whole expanded size again) of at most `object_budget` of the
  file's size (work), and at most `container_budget` containers and objects built
  (memory); both scale with the size, at a few times what real DCP metadata uses. The
  builtins admitted are wrapped: ``bytearray`` only from a bytes literal, never from a
  length.
- A pickle can ``BUILD`` onto an admitted *class* (or function, or enum member) and
  overwrite its attributes for the whole process. The scan refuses a ``BUILD`` onto
  anything but an object a DCP class just made; those objects' dicts are also compared
  before and after each load (a second line: a change is undone and refused).
- An admitted class built with the wrong fields. The result must be a `Metadata` whose
  ``storage_data`` maps `MetadataIndex` to `_StorageInfo` with a valid file name, and
  non-negative int offset and length.

No lock is held across a load (loads on many threads run side by side), and the C
unpickler reads through a Python source (`_Source`), so a long load lets other threads
run at least every frame (64 KiB) instead of holding the GIL to the end.

Anything else raises `tierckpt.errors.UnsafeMetadata`, which names what was refused and
runs nothing. torch is imported on first use: when the pickle names its first global
(the daemon's decoding child, `tierckptd.persistent.decode`, then imports it; a pickle of
plain containers, a bomb, never does).
"""

from __future__ import annotations

import enum
import functools
import importlib
import io
import pickle
import reprlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

from tierckpt.errors import InvalidName, UnsafeMetadata
from tierckpt.names import METADATA_FILE, check_file_name
from tierckpt.pickle_scan import ScanRefused, scan

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "MAX_METADATA_BYTES",
    "dump_metadata",
    "load_metadata",
    "container_budget",
    "object_budget",
    "unpickle_allowed",
]

MAX_METADATA_BYTES = 256 << 20
"""A `.metadata` larger than this is refused before it is parsed (2,000 tensors of 64
chunks each, 128k items, is 18 MB)."""

OBJECTS_PER_BYTE = 2
"""The logical object budget per byte of input (real DCP metadata: 0.27, measured on
2,000 tensors of 64 chunks, 17.9 MB): bounds the decoder's work (hashing, compares).
The scan charges memo GETs and long literals against all but one object per byte (the
ops it does not count one by one), so 2 is the least that admits real files (their
GETs alone pass the 1M minimum on 17.9 MB)."""

MIN_OBJECTS = 1 << 20
"""The logical object budget of any input, however small (milliseconds of hashing)."""

CONTAINER_BYTES = 4
"""One container or object built per this many bytes of input at most (real DCP
metadata: one per 9.2 bytes, 0.108 per byte): bounds the decoder's memory, so a hostile
file holds at most about twice what a real one of its size holds (a 16 MB file of empty
lists was 16M lists, 2 GiB)."""

MIN_CONTAINERS = 1 << 16
"""The container budget of any input, however small (at most about 16 MB of objects)."""


def object_budget(size: int) -> int:
    """The most logical objects (expanded, see `tierckpt.pickle_scan`) a pickle of `size`
    bytes may build."""
    return MIN_OBJECTS + OBJECTS_PER_BYTE * size


def container_budget(size: int) -> int:
    """The most containers and objects (`tierckpt.pickle_scan`) a pickle of `size` bytes
    may build."""
    return MIN_CONTAINERS + size // CONTAINER_BYTES


OUT_OF_MEMORY = "decoding it ran out of memory (MemoryError)"
"""The refusal's cause when the decoding process hit its memory limit."""

_MAX_INT = 2**63 - 1
_SHOWN = 64  # characters of a refused name or value that go into an error message

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_LEGACY_METADATA = "torch.distributed._shard.sharded_tensor.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_ALLOWED: dict[str, frozenset[str]] = {
    # DCP's metadata types (2.2+: TensorProperties and its encoding live here).
    _DCP_METADATA: frozenset(
        {
            "Metadata",  # the root object FileSystemWriter.finish pickles
            "MetadataIndex",  # the keys of Metadata.storage_data
            "TensorStorageMetadata",  # a tensor's entry in state_dict_metadata
            "BytesStorageMetadata",  # a non-tensor (torch.save'd) entry
            "ChunkStorageMetadata",  # TensorStorageMetadata.chunks
            "TensorProperties",  # TensorStorageMetadata.properties
            "StorageMeta",  # Metadata.storage_meta (2.4+)
            "_MEM_FORMAT_ENCODING",  # TensorProperties.__getstate__ (memory_format)
        }
    ),
    # Before 2.2, DCP's TensorProperties was sharded_tensor's: checkpoints of those
    # versions name it and its encoding, and DCP guarantees they still load.
    _LEGACY_METADATA: frozenset({"TensorProperties", "MEM_FORMAT_ENCODING"}),
    # The values of Metadata.storage_data (FileSystemWriter and FsspecWriter).
    _FILESYSTEM: frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),  # sizes, chunk offsets and sizes, MetadataIndex.offset
    # dtypes and memory formats pickle as torch.<name> (see find_class); a layout as:
    "torch.serialization": frozenset({"_get_layout"}),
    # StorageMeta.checkpoint_id may be a path (FileSystemWriter passes one).
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath"}),  # Python 3.13+
    # Containers that have no opcode of their own (planner_data may hold them).
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "bytearray", "complex", "slice"}),
}

_ENUMS = frozenset(
    {(_DCP_METADATA, "_MEM_FORMAT_ENCODING"), (_LEGACY_METADATA, "MEM_FORMAT_ENCODING")}
)
"""Admitted globals a REDUCE hands a member of (never a fresh object a BUILD may fill)."""

# Fresh objects a BUILD may fill, and containers SETITEM/APPENDS/ADDITEMS may fill.
_FRESH = frozenset(
    {(module, name) for module in (_DCP_METADATA, _LEGACY_METADATA) for name in _ALLOWED[module]}
    - _ENUMS
    | {(_FILESYSTEM, "_StorageInfo")}
    | {(module, name) for module in ("pathlib", "pathlib._local") for name in _ALLOWED[module]}
)
_CONTAINERS = frozenset({("collections", "OrderedDict"), ("builtins", "set")})


def _bytearray(*args: object) -> bytearray:
    """``builtins.bytearray`` as a pickle may call it: from a bytes literal only (how
    protocol 3 and 4 write one), never from a length (``bytearray(1 << 29)``)."""
    if args and not (len(args) == 1 and type(args[0]) is bytes):
        raise UnsafeMetadata("bytearray() from anything but a bytes literal")
    return bytearray(*args)


_WRAPPED = {("builtins", "bytearray"): _bytearray}

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _SHOWN
_REPR.maxlevel = 3


def _shown(value: object) -> str:
    """A short text for `value` in an error, in bounded time: never the repr of a whole
    structure (a pickle may build one whose repr is exponential)."""
    if type(value) is int and value.bit_length() > 64:
        return f"<an int of {value.bit_length()} bits>"
    if type(value) in (str, bytes, int, float, bool, type(None), list, tuple, dict, set):
        text = _REPR.repr(value)
    else:
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _refuse(what: str, why: str) -> UnsafeMetadata:
    return UnsafeMetadata(
        f"{what}: refused, not plain DCP metadata ({why}); nothing in it was run. Re-save "
        "the checkpoint with dcp.save, or delete it if you did not write it"
    )


class _AllowListUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `_ALLOWED` globals and torch's dtype and
    layout constants; no persistent ids."""

    def __init__(
        self,
        data: bytes,
        what: str,
        extra: Mapping[tuple[str, str], type] | None = None,
    ) -> None:
        super().__init__(_Source(data))
        self.what = what
        self.extra = extra or {}
        self.before: list[tuple[Any, dict[str, Any]]] | None = None
        self.with_torch = False

    def _guard(self, with_torch: bool) -> None:
        """Take the state of the guarded globals (torch's too when `with_torch`) not
        taken yet: before the first global is handed out, and before the first of torch
        (nothing can BUILD onto one earlier). A pickle of plain containers, a bomb,
        never imports torch; one naming only ``pathlib`` or ``builtins`` neither."""
        taken = {id(obj) for obj, _ in self.before or []}
        guarded = _guarded(with_torch) + tuple(self.extra.values())
        fresh = _snapshot(obj for obj in guarded if id(obj) not in taken)
        self.before = [*(self.before or []), *fresh]
        self.with_torch = self.with_torch or with_torch

    def find_class(self, module: str, name: str) -> Any:
        wants_torch = module == "torch" or module.startswith("torch.")
        if self.before is None or (wants_torch and not self.with_torch):
            self._guard(wants_torch)
        if (module, name) in self.extra:
            return self.extra[(module, name)]
        if (module, name) in _WRAPPED:
            return _WRAPPED[(module, name)]
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None) if name.isidentifier() else None
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise _refuse(self.what, f"it refers to {_shown(f'{module}.{name}')}")

    def persistent_load(self, pid: Any) -> Any:
        raise _refuse(self.what, "it refers to a persistent id")


class _Source:
    """The pickle's bytes as a file the C unpickler reads through Python calls (``peek``
    prefetches 128 KiB, a frame is 64 KiB): each call lets a waiting thread take the GIL,
    which a load from ``bytes`` would hold to the end."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._view = memoryview(data)
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n is None or n < 0 else min(len(self._data), self._pos + n)
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        chunk = self._view[self._pos : self._pos + len(out)]
        out[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def readline(self) -> bytes:
        end = self._data.find(b"\n", self._pos)
        return self.read(-1 if end < 0 else end + 1 - self._pos)

    def peek(self, n: int = 0) -> bytes:
        return self._data[self._pos : self._pos + max(n, 1)]


@functools.cache
def _guarded(with_torch: bool) -> tuple[Any, ...]:
    """The admitted globals a `BUILD` could write into (classes, `_get_layout`), and
    the enum members a `REDUCE` hands out (process-wide singletons); torch's only when
    `with_torch` (importing it)."""
    if with_torch:
        import torch.distributed._shard.sharded_tensor.metadata  # noqa: F401
        import torch.distributed.checkpoint.filesystem  # noqa: F401 - imports the modules
        import torch.distributed.checkpoint.metadata  # noqa: F401

    found: list[Any] = []
    for module, names in _ALLOWED.items():
        if not with_torch and module.split(".")[0] == "torch":
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue  # pathlib._local before Python 3.13
        for name in names:
            value = getattr(mod, name, None)
            if hasattr(value, "__dict__"):
                found.append(value)
                if isinstance(value, enum.EnumMeta):
                    found.extend(value)
    return tuple(found)


def _snapshot(objects: Iterable[Any]) -> list[tuple[Any, dict[str, Any]]]:
    return [(obj, dict(vars(obj))) for obj in objects]


def _undo_changes(before: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """Restore every guarded object whose attributes a `BUILD` changed; their names."""
    changed = []
    for obj, saved in before:
        now = vars(obj)
        if now.keys() == saved.keys() and all(now[k] is v for k, v in saved.items()):
            continue
        changed.append(getattr(obj, "__qualname__", None) or repr(obj))
        if isinstance(obj, type):  # a class's dict is read-only: go through setattr
            for key in set(now) - set(saved):
                delattr(obj, key)
            for key, value in saved.items():
                if now.get(key) is not value:
                    setattr(obj, key, value)
        else:
            now.clear()
            now.update(saved)
    return changed


def _check_int(value: object, field: str, what: str) -> None:
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise _refuse(what, f"{field} is {_shown(value)}, not an int in 0..2**63-1")


def _check_shape(md: object, what: str) -> None:
    if type(md).__module__ != _DCP_METADATA:  # before importing torch (a bomb never does)
        raise _refuse(what, f"it holds a {type(md).__name__}, not a Metadata")
    import torch
    from torch.distributed._shard.sharded_tensor.metadata import (
        TensorProperties as LegacyTensorProperties,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if type(md) is not Metadata:
        raise _refuse(what, f"it holds a {type(md).__name__}, not a Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise _refuse(what, "state_dict_metadata is not a dict")
    for fqn, entry in sdm.items():
        if type(fqn) is not str:
            raise _refuse(what, f"state_dict_metadata key {_shown(fqn)} is not a str")
        if type(entry) is TensorStorageMetadata:
            if type(entry.properties) not in (TensorProperties, LegacyTensorProperties):
                raise _refuse(what, f"{_shown(fqn)} has no TensorProperties")
            if type(entry.size) is not torch.Size or not isinstance(entry.chunks, list):
                raise _refuse(what, f"{_shown(fqn)} has a malformed size or chunk list")
            for chunk in entry.chunks:
                if not (
                    type(chunk) is ChunkStorageMetadata
                    and type(chunk.offsets) is torch.Size
                    and type(chunk.sizes) is torch.Size
                ):
                    raise _refuse(what, f"{_shown(fqn)} has a malformed chunk")
        elif type(entry) is not BytesStorageMetadata:
            raise _refuse(what, f"{_shown(fqn)} is described by a {type(entry).__name__}")
    meta = getattr(md, "storage_meta", None)
    if meta is not None and type(meta) is not StorageMeta:
        raise _refuse(what, f"storage_meta is a {type(meta).__name__}")
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise _refuse(what, "storage_data is not a dict of items")
    for key, info in storage.items():
        if type(key) is not MetadataIndex or type(getattr(key, "fqn", None)) is not str:
            raise _refuse(what, f"storage_data key {_shown(key)} is not a MetadataIndex")
        if type(info) is not _StorageInfo:
            raise _refuse(what, f"item {_shown(key.fqn)} is a {type(info).__name__}")
        path = getattr(info, "relative_path", None)
        try:
            check_file_name(path)
        except InvalidName:
            raise _refuse(what, f"item {_shown(key.fqn)} is in file {_shown(path)}") from None
        if path == METADATA_FILE:
            raise _refuse(what, f"item {_shown(key.fqn)} is in {METADATA_FILE} itself")
        _check_int(getattr(info, "offset", None), "an item's offset", what)
        _check_int(getattr(info, "length", None), "an item's length", what)
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and not (
            isinstance(transforms, list | tuple) and all(type(t) is str for t in transforms)
        ):
            raise _refuse(what, f"item {_shown(key.fqn)} has malformed transform descriptors")


def _unpickle(
    raw: bytes | bytearray | memoryview, what: str, extra: Mapping[tuple[str, str], type]
) -> Any:
    size = memoryview(raw).nbytes
    if size > MAX_METADATA_BYTES:
        raise _refuse(what, f"{size} bytes, more than the {MAX_METADATA_BYTES} allowed")
    data = raw if isinstance(raw, bytes) else bytes(raw)
    try:
        scan(
            data,
            budget=object_budget(size),
            containers_budget=container_budget(size),
            fresh=_FRESH | frozenset(extra),
            containers=_CONTAINERS,
        )
    except ScanRefused as e:
        why = f"unreadable: {e}" if e.malformed else str(e)
        raise _refuse(what, why if len(why) <= 300 else why[:297] + "...") from None
    unpickler = _AllowListUnpickler(data, what, extra)
    try:
        return unpickler.load()
    except UnsafeMetadata as e:
        if str(e).startswith(what):
            raise
        raise _refuse(what, str(e)) from None  # a wrapped builtin's refusal
    except MemoryError:
        raise _refuse(what, OUT_OF_MEMORY) from None
    except Exception as e:  # UnpicklingError, EOFError, RecursionError...
        raise _refuse(what, f"unreadable: {type(e).__name__}: {_shown(str(e))}") from None
    finally:
        changed = _undo_changes(unpickler.before or [])
        if changed:
            raise _refuse(what, f"it tried to change {_shown(', '.join(changed))}")


def unpickle_allowed(
    raw: bytes | bytearray | memoryview,
    *,
    what: str,
    extra_classes: Mapping[tuple[str, str], type],
) -> Any:
    """Decode a DCP-like pickle that names classes of another writer (the SageMaker
    client's storage info): each ``(module, name)`` in `extra_classes` resolves to the
    given inert stand-in class; everything else as in `load_metadata`. The result is NOT
    shape-checked: the caller converts it and re-checks it with `load_metadata`.

    Raises:
        UnsafeMetadata: as `load_metadata`.
    """
    return _unpickle(raw, what, extra_classes)


def load_metadata(raw: bytes | bytearray | memoryview, *, what: str = METADATA_FILE) -> Metadata:
    """Decode a `.metadata` without running any code from it.

    Args:
        raw: the file's bytes.
        what: names the file in errors (e.g. ``"ns/step-1/.metadata"``).

    Raises:
        UnsafeMetadata: a global outside the allow-list, a class changed, the wrong
            shape, too large, or not a pickle at all.
    """
    md = _unpickle(raw, what, {})
    try:
        _check_shape(md, what)
    except UnsafeMetadata:
        raise
    except Exception as e:  # a field missing, a hash of an unhashable, ...
        raise _refuse(what, f"malformed: {type(e).__name__}: {_shown(str(e))}") from None
    return cast("Metadata", md)


def dump_metadata(md: Metadata) -> bytes:
    """`.metadata` bytes, pickled as ``FileSystemWriter.finish`` does."""
    buffer = io.BytesIO()
    pickle.dump(md, buffer)
    return buffer.getvalue()
