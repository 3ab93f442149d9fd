"""Safe decoding of DCP's `.metadata`: an allow-list unpickler, then a shape check.

`.metadata` is a pickle (DCP's format), and its bytes come from ranks, peers and buckets,
none of which the daemon or a training process may trust: ``pickle.loads`` on it runs
whatever ``__reduce__`` the writer chose. `load_metadata` resolves only the globals a
real DCP `.metadata` refers to (torch 2.6 to 2.13, with or without the zstd stream
extension; found with ``pickletools.dis`` on ``dcp.save`` output): DCP's metadata
dataclasses, ``torch.Size``, dtypes and layouts, ``pathlib`` paths (``storage_meta``'s
checkpoint id) and a few builtin containers. Every one of them is inert to construct. No
callable that reaches the filesystem, the interpreter or torch storages is admitted.

Two more things the allow-list alone would not stop:

- A pickle can ``BUILD`` onto an admitted *class* (or function, or enum member) and
  overwrite its attributes for the whole process. Loads are serialized, those objects'
  dicts are compared before and after, and any change is undone and refused.
- An admitted class built with the wrong fields. The result must be a `Metadata` whose
  ``storage_data`` maps `MetadataIndex` to `_StorageInfo` with a valid file name, and
  non-negative int offset and length.

Anything else raises `tierckpt.errors.UnsafeMetadata`, which names what was refused and
runs nothing. torch is imported on first use (the daemon does not otherwise need it).
"""

from __future__ import annotations

import enum
import functools
import importlib
import io
import pickle
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

from tierckpt.errors import InvalidName, UnsafeMetadata
from tierckpt.names import METADATA_FILE, check_file_name

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["MAX_METADATA_BYTES", "dump_metadata", "load_metadata", "unpickle_allowed"]

MAX_METADATA_BYTES = 1 << 30
"""A `.metadata` larger than this is refused before it is parsed (160k items is ~30 MB)."""

_MAX_INT = 2**63 - 1
_SHOWN = 64  # characters of a refused name or value that go into an error message

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),  # how a torch.layout pickles
    # StorageMeta.checkpoint_id may be a path (FileSystemWriter passes one).
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath"}),  # Python 3.13+
    # Containers that have no opcode of their own (planner_data may hold them).
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "bytearray", "complex", "slice"}),
}

# One load at a time, so the class-dict check below sees only its own load's effects.
_LOCK = threading.Lock()


def _shown(value: object) -> str:
    text = repr(value)
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
        data: bytes | bytearray | memoryview,
        what: str,
        extra: Mapping[tuple[str, str], type] | None = None,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self.what = what
        self.extra = extra or {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.extra:
            return self.extra[(module, name)]
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


@functools.cache
def _guarded() -> tuple[Any, ...]:
    """The admitted globals a `BUILD` could write into (classes, `_get_layout`), and
    the enum members a `REDUCE` hands out (process-wide singletons)."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401 - imports the modules
    import torch.distributed.checkpoint.metadata  # noqa: F401

    found: list[Any] = []
    for module, names in _ALLOWED.items():
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
    import torch
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
            if type(entry.properties) is not TensorProperties:
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
    guarded = _guarded() + tuple(extra.values())
    with _LOCK:
        before = _snapshot(guarded)
        try:
            return _AllowListUnpickler(raw, what, extra).load()
        except UnsafeMetadata:
            raise
        except Exception as e:  # UnpicklingError, EOFError, RecursionError, MemoryError...
            raise _refuse(what, f"unreadable: {type(e).__name__}: {_shown(str(e))}") from None
        finally:
            changed = _undo_changes(before)
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
