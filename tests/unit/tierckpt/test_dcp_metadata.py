"""`load_metadata`: every real DCP `.metadata` loads as `pickle.loads` would load it; a
hostile one is refused before any of it runs (no marker file), with a clear error."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt.dcp_metadata import dump_metadata, load_metadata
from tierckpt.errors import InvalidArgument, UnsafeMetadata
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import (
    MEM_FORMAT_ENCODING,
    ShardedTensorMetadata,
)
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.serialization import _get_layout

from tests.support.dcp_files import make_state, save_two_rank_checkpoint
from tests.support.legacy_dcp import LEGACY_MODULE, LegacyTensorProperties, save_legacy_checkpoint

_DTYPES = [
    "float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]  # fmt: skip


def _every_kind_of_state() -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name in _DTYPES:
        dtype = getattr(torch, name, None)
        if dtype is not None:
            state[name] = torch.arange(12, dtype=torch.float32).reshape(4, 3).to(dtype)
    state["transposed"] = torch.zeros(4, 3).t()
    state["channels_last"] = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    state["scalar"] = torch.tensor(3.0)
    state["empty"] = torch.zeros(0)
    state["grad"] = torch.zeros(2, requires_grad=True)
    state["objects"] = {"a": 1, "b": [1, 2, "x"], "c": (1.5, None), "d": b"raw", "s": {1, 2}}
    state["step"] = 5
    state.update(make_state(seed=1))
    return state


@pytest.mark.parametrize("zstd", [False, True], ids=["plain", "zstd-extension"])
def test_real_dcp_metadata_loads_like_pickle(tmp_path: Path, zstd: bool) -> None:
    extensions = {"_extensions": [ZStandard()]} if zstd else {}
    dcp.save(
        _every_kind_of_state(),
        storage_writer=dcp.FileSystemWriter(str(tmp_path), **extensions),  # type: ignore[arg-type]
    )
    raw = (tmp_path / ".metadata").read_bytes()
    md = load_metadata(raw)
    assert md == pickle.loads(raw)
    assert isinstance(md.storage_meta.checkpoint_id, os.PathLike)  # type: ignore[union-attr]
    props = md.state_dict_metadata["bfloat16"].properties  # type: ignore[union-attr]
    assert props.dtype == torch.bfloat16 and props.layout == torch.strided
    infos = list(md.storage_data.values())
    assert all(bool(i.transform_descriptors) is zstd for i in infos)
    assert load_metadata(dump_metadata(md)) == md  # what rewrite_metadata re-pickles


def test_a_multi_file_checkpoint_and_a_copy_through_pickle_protocols(tmp_path: Path) -> None:
    raw = save_two_rank_checkpoint(tmp_path).metadata
    md = load_metadata(raw)
    assert {i.relative_path for i in md.storage_data.values()} == {
        "__0_0.distcp",
        "__1_0.distcp",
    }
    for protocol in (2, 3, 4, 5):
        assert load_metadata(pickle.dumps(md, protocol=protocol)) == md


# ---- hostile payloads -------------------------------------------------------------------


class _Shell:
    """Unpickling runs ``cmd`` with os.system (what the audit's C1 repro does)."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


class _Reduce:
    """Unpickling calls ``fn(*args)``."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(s: str) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s.encode()


def _hostile(marker: Path) -> dict[str, bytes]:
    touch = f"touch {shlex.quote(str(marker))}"
    real = Metadata(
        state_dict_metadata={},
        storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 8)},
    )
    wrapped = dataclasses.replace(real, planner_data=_Shell(touch))
    return {
        "os.system": pickle.dumps(_Shell(touch)),
        "os.system inside real metadata": pickle.dumps(wrapped),
        "builtins.eval": pickle.dumps(_Reduce(eval, f"__import__('os').system({touch!r})")),
        "builtins.exec": pickle.dumps(_Reduce(exec, f"open({str(marker)!r}, 'w')")),
        "getattr gadget": (
            b"\x80\x04" + _global("builtins", "getattr") + _global("os", "path") + _str("join")
            + b"\x86R."
        ),
        "subprocess": pickle.dumps(_Reduce(subprocess.call, ["touch", str(marker)])),
        "torch _rebuild_tensor": (
            b"\x80\x04" + _global("torch._utils", "_rebuild_tensor_v2") + b")R."
        ),
        "torch.load": b"\x80\x04" + _global("torch", "load") + _str(str(marker)) + b"\x85R.",
        "copyreg._reconstructor": (
            b"\x80\x04" + _global("copyreg", "_reconstructor") + _global("os", "system") + b"N"
            + _str(touch) + b"\x87R."
        ),
        "dotted name": (
            b"\x80\x04" + _global(
                "torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"
            ) + b"."
        ),
        "persistent id": b"\x80\x04" + _str("x") + b"Q.",
        "open file": pickle.dumps(_Reduce(open, str(marker), "w")),
    }  # fmt: skip


def test_hostile_payloads_are_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    for what, payload in _hostile(marker).items():
        with pytest.raises(UnsafeMetadata) as refused:
            load_metadata(payload, what=f"ns/ckpt/.metadata ({what})")
        message = str(refused.value)
        assert "ns/ckpt/.metadata" in message and "refused" in message, what
        assert not marker.exists(), f"{what} ran"
    # The same bytes do run through plain pickle: the test payload is real.
    pickle.loads(_hostile(marker)["os.system"])
    assert marker.exists()


def test_the_error_names_the_global_and_is_an_invalid_argument() -> None:
    with pytest.raises(UnsafeMetadata, match=r"posix\.system") as refused:
        load_metadata(pickle.dumps(_Shell("true")))
    assert isinstance(refused.value, InvalidArgument)
    long_name = "x" * 5000
    with pytest.raises(UnsafeMetadata) as refused:
        load_metadata(b"\x80\x04" + _global("os", long_name) + b".")
    assert len(str(refused.value)) < 400  # an unbounded name is not echoed


def _good() -> Metadata:
    return Metadata(
        state_dict_metadata={},
        storage_data={MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", 0, 8)},
    )


def _with_item(**fields: Any) -> bytes:
    md = _good()
    info = _StorageInfo("__0_0.distcp", 0, 8)
    info.__dict__.update(fields)
    md.storage_data = {MetadataIndex("w", [0]): info}
    return pickle.dumps(md)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (pickle.dumps({"not": "metadata"}), "dict, not a Metadata"),
        (pickle.dumps([1, 2]), "list, not a Metadata"),
        (pickle.dumps(_StorageInfo("a", 0, 1)), "_StorageInfo, not a Metadata"),
        (_with_item(relative_path="../x"), "in file '../x'"),
        (_with_item(relative_path="a/b"), "in file 'a/b'"),
        (_with_item(relative_path="/etc/passwd"), "in file"),
        (_with_item(relative_path=".metadata"), ".metadata itself"),
        (_with_item(relative_path=b"x"), "in file b'x'"),
        (_with_item(offset=-1), "offset is -1"),
        (_with_item(offset="0"), "offset is '0'"),
        (_with_item(offset=True), "offset is True"),
        (_with_item(length=2**64), "length is"),
        (_with_item(length=1.5), "length is 1.5"),
        (_with_item(transform_descriptors=[1]), "transform descriptors"),
        (
            pickle.dumps(dataclasses.replace(_good(), storage_data=[1])),
            "storage_data is not a dict",
        ),
        (
            pickle.dumps(dataclasses.replace(_good(), storage_data={"w": _StorageInfo("a", 0, 1)})),
            "not a MetadataIndex",
        ),
        (
            pickle.dumps(dataclasses.replace(_good(), storage_data={MetadataIndex("w"): "x"})),
            "is a str",
        ),
        (pickle.dumps(dataclasses.replace(_good(), state_dict_metadata={"w": 1})), "int"),
        (pickle.dumps(dataclasses.replace(_good(), storage_meta="x")), "storage_meta"),
        (b"", "unreadable"),
        (b"not a pickle at all", "unreadable"),
        (pickle.dumps(_good())[:-20], "unreadable"),
        (b"\x80\x04" + b"(" * 100_000 + b".", "unreadable"),
    ],
)
def test_wrong_shapes_are_refused(payload: bytes, why: str) -> None:
    with pytest.raises(UnsafeMetadata) as refused:
        load_metadata(payload)
    assert why in str(refused.value)


def test_oversized_metadata_is_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    import tierckpt.dcp_metadata as module

    raw = pickle.dumps(_good())
    monkeypatch.setattr(module, "MAX_METADATA_BYTES", len(raw) - 1)
    with pytest.raises(UnsafeMetadata, match="more than"):
        load_metadata(raw)


def test_build_onto_admitted_globals_is_undone_and_refused() -> None:
    """BUILD can write into an admitted class, function or enum member for the whole
    process; every such change is reverted and the file refused."""
    md_module = "torch.distributed.checkpoint.metadata"
    hash_before = MetadataIndex.__hash__
    member = _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST
    legacy_member = MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST
    payloads = {
        "new class attribute": (
            b"\x80\x04" + _global(md_module, "Metadata") + b"N}" + _str("evil") + _str("x")
            + b"s\x86b."
        ),
        "replaced method": (
            b"\x80\x04" + _global(md_module, "MetadataIndex") + b"N}" + _str("__hash__")
            + _global("torch", "Size") + b"s\x86b."
        ),
        "enum member": (
            b"\x80\x04" + _global(md_module, "_MEM_FORMAT_ENCODING") + b"K\x01\x85R}"
            + _str("_value_") + b"K\x07sb."
        ),
        "legacy class attribute": (
            b"\x80\x04" + _global(LEGACY_MODULE, "TensorProperties") + b"N}" + _str("evil")
            + _str("x") + b"s\x86b."
        ),
        "legacy enum member": (
            b"\x80\x04" + _global(LEGACY_MODULE, "MEM_FORMAT_ENCODING") + b"K\x01\x85R}"
            + _str("_value_") + b"K\x07sb."
        ),
        "layout cache": (
            b"\x80\x04" + _global("torch.serialization", "_get_layout") + b"}" + _str("cache")
            + b"}sb."
        ),
    }  # fmt: skip
    cache_before = vars(_get_layout)["cache"]
    for what, payload in payloads.items():
        with pytest.raises(UnsafeMetadata, match="tried to change"):
            load_metadata(payload)
        assert not hasattr(Metadata, "evil"), what
        assert MetadataIndex.__hash__ is hash_before, what
        assert member._value_ == 1 and _MEM_FORMAT_ENCODING(1) is member, what
        assert not hasattr(LegacyTensorProperties, "evil"), what
        assert legacy_member._value_ == 1 and MEM_FORMAT_ENCODING(1) is legacy_member, what
        assert vars(_get_layout)["cache"] is cache_before, what
    props = TensorProperties(dtype=torch.float32, memory_format=torch.channels_last)
    assert pickle.loads(pickle.dumps(props)).memory_format == torch.channels_last


# ---- the legacy sharded-tensor metadata (torch < 2.2 checkpoints) ---------------------


def test_a_legacy_sharded_tensor_metadata_loads_like_pickle(tmp_path: Path) -> None:
    """DCP's compatibility contract: a `.metadata` naming sharded_tensor's TensorProperties
    (written by a stock save, as torch's own test writes it) loads, and re-pickles as such."""
    raw = save_legacy_checkpoint(tmp_path).metadata
    md = load_metadata(raw, what="ns/legacy/.metadata")
    assert md == pickle.loads(raw)
    tensors = [e for e in md.state_dict_metadata.values() if type(e) is TensorStorageMetadata]
    assert tensors and all(type(e.properties) is LegacyTensorProperties for e in tensors)
    assert load_metadata(dump_metadata(md)) == md  # what rewrite_metadata re-pickles


@pytest.mark.parametrize(
    "memory_format", [torch.contiguous_format, torch.channels_last, torch.preserve_format]
)
def test_legacy_properties_keep_their_fields(memory_format: torch.memory_format) -> None:
    props = LegacyTensorProperties(
        dtype=torch.bfloat16, requires_grad=True, memory_format=memory_format, pin_memory=True
    )
    size = torch.Size([2, 3])
    md = dataclasses.replace(
        _good(),
        state_dict_metadata={
            "w": TensorStorageMetadata(
                props, size, [ChunkStorageMetadata(torch.Size([0, 0]), size)]
            )
        },
    )
    got = load_metadata(pickle.dumps(md)).state_dict_metadata["w"]
    assert got == md.state_dict_metadata["w"]
    assert got.properties.memory_format == memory_format  # type: ignore[union-attr]


def _refused_inside_metadata(**fields: Any) -> str:
    with pytest.raises(UnsafeMetadata) as refused:
        load_metadata(pickle.dumps(dataclasses.replace(_good(), **fields)))
    return str(refused.value)


def test_the_sharded_tensor_classes_dcp_never_writes_stay_refused() -> None:
    """Only the two legacy classes DCP pickled are admitted: the rest of the sharded-tensor
    metadata (its module's ShardedTensorMetadata, ShardMetadata and its remote device)
    is still refused, wherever it sits."""
    shard = ShardMetadata([0], [4])
    assert "ShardedTensorMetadata" in _refused_inside_metadata(
        planner_data=ShardedTensorMetadata([], torch.Size([4]))
    )
    assert "ShardMetadata" in _refused_inside_metadata(planner_data={"w": shard})
    assert "ShardMetadata" in _refused_inside_metadata(storage_meta=shard)
    placed = ShardMetadata([0], [4], "rank:0/cpu")
    assert "_remote_device" in _refused_inside_metadata(planner_data=[placed])
    # An admitted class in the wrong place is the wrong shape.
    size = torch.Size([4])
    entry = TensorStorageMetadata(StorageMeta(), size, [])  # type: ignore[arg-type]
    why = _refused_inside_metadata(state_dict_metadata={"w": entry})
    assert "has no TensorProperties" in why


def test_every_class_of_dcps_metadata_types_resolves_and_nothing_beside_it() -> None:
    """Read from DCP's types: every class `torch.distributed.checkpoint.metadata` exports
    (a new one in a later torch fails here until it is reviewed), the enum its
    TensorProperties pickles, the file system's `_StorageInfo` and the legacy pair resolve;
    DCP's planner and storage types, which never reach `.metadata`, do not."""
    import torch.distributed.checkpoint.metadata as dcp_metadata
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem
    from torch.distributed.checkpoint.storage import WriteResult

    exported = [getattr(dcp_metadata, name) for name in dcp_metadata.__all__]
    classes = [c for c in exported if isinstance(c, type)]
    admitted = [*classes, _MEM_FORMAT_ENCODING, _StorageInfo, LegacyTensorProperties]
    admitted.append(MEM_FORMAT_ENCODING)
    md = load_metadata(pickle.dumps(dataclasses.replace(_good(), planner_data=admitted)))
    assert md.planner_data == admitted
    for other in (WriteItem, SavePlan, WriteResult, ShardMetadata, ShardedTensorMetadata):
        with pytest.raises(UnsafeMetadata, match=other.__name__):
            load_metadata(pickle.dumps(dataclasses.replace(_good(), planner_data=other)))
