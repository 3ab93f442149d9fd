"""Audit 3, H1 in the daemon: `.metadata` is decoded in a child process with RLIMIT_AS
and RLIMIT_CPU scaled to its size (`tierckptd.persistent.decode`), never in the daemon.

The child returns plain rows (JSON) and, for the zstd rewrite, bytes it pickled itself;
a child stopped by a limit is a refusal (`UnsafeMetadata`, INVALID_ARGUMENT) that names
the limit; a real `.metadata` comes back exactly as torch's own reader sees it.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
from tierckpt.errors import InvalidArgument, UnsafeMetadata
from tierckptd.persistent import decode
from tierckptd.persistent.format import ZSTD_DESCRIPTOR, data_files, rewrite_metadata
from torch.distributed._shard.metadata import ShardMetadata

from tests.support.large_metadata import large_metadata_bytes
from tests.support.legacy_dcp import LegacyTensorProperties, save_legacy_checkpoint
from tests.unit.tierckpt.test_metadata_bounds import bombs


def padded_lists(n: int) -> bytes:
    """n empty lists in one list, each padded to 5 bytes (``N0``: push None, pop): one
    container per 5 bytes passes the scan's bound (one per 4), so only the child's own
    limits stop it."""
    return b"\x80\x02(" + b"]N0N0" * n + b"l."


def rows(raw: bytes) -> dict[str, tuple[tuple[int, int], ...]]:
    """Each data file's sorted distinct items, from torch's own unpickling."""
    found: dict[str, set[tuple[int, int]]] = {}
    for info in pickle.loads(raw).storage_data.values():
        found.setdefault(info.relative_path, set()).add((info.offset, info.length))
    return {path: tuple(sorted(items)) for path, items in found.items()}


def test_a_real_large_metadata_comes_back_as_torch_reads_it() -> None:
    """2,000 tensors x 64 chunks (17.9 MB): the child's rows are pickle.loads' rows,
    and its zstd rewrite is the same metadata with the new offsets."""
    raw = large_metadata_bytes(2000, 64)
    assert len(raw) > 17_000_000
    files = data_files(raw, what="ns/big/.metadata")
    assert {path: f.items for path, f in files.items()} == rows(raw)
    assert not any(f.transformed for f in files.values())

    small = large_metadata_bytes(40, 4)
    mappings = {
        path: {offset: (offset + 1, length + 2) for offset, length in items}
        for path, items in rows(small).items()
    }
    rewritten = pickle.loads(rewrite_metadata(small, mappings, what="ns/small/.metadata"))
    original = pickle.loads(small)
    assert rewritten.state_dict_metadata == original.state_dict_metadata
    assert rewritten.storage_data.keys() == original.storage_data.keys()
    for key, info in rewritten.storage_data.items():
        before = original.storage_data[key]
        assert (info.offset, info.length) == (before.offset + 1, before.length + 2)
        assert info.transform_descriptors == [ZSTD_DESCRIPTOR]
    with pytest.raises(ValueError, match="no compressed frame"):
        rewrite_metadata(small, {"__0_0.distcp": {}}, what="ns/small/.metadata")


def test_a_child_past_its_memory_limit_is_a_refusal_naming_the_limit() -> None:
    raw = padded_lists(2_000_000)  # 10 MB that the scan admits: 2M lists
    limits = decode.Limits(memory=160 << 20, cpu_s=60, wall_s=300)
    with pytest.raises(UnsafeMetadata) as refused:
        decode.decode(raw, what="ns/lists/.metadata", limits=limits)
    message = str(refused.value)
    assert message.startswith("ns/lists/.metadata: refused"), message
    assert "memory limit (RLIMIT_AS 160 MiB" in message, message
    assert isinstance(refused.value, InvalidArgument)  # INVALID_ARGUMENT on the wire


def test_a_child_past_its_cpu_limit_is_a_refusal_naming_the_limit() -> None:
    raw = padded_lists(4_000_000)  # 20 MB: seconds of scanning
    limits = decode.Limits(memory=4 << 30, cpu_s=1, wall_s=300)
    with pytest.raises(UnsafeMetadata) as refused:
        decode.decode(raw, what="ns/slow/.metadata", limits=limits)
    message = str(refused.value)
    assert message.startswith("ns/slow/.metadata: refused"), message
    assert "CPU limit (RLIMIT_CPU 1 s" in message, message


def test_the_audit_bombs_are_refused_by_the_child_as_in_process() -> None:
    for name, raw in bombs().items():
        with pytest.raises(UnsafeMetadata, match=rf"ns/{name}/\.metadata: refused"):
            data_files(raw, what=f"ns/{name}/.metadata")


def test_the_limits_scale_with_the_size() -> None:
    small, big = decode.Limits.for_size(1 << 20), decode.Limits.for_size(256 << 20)
    assert small.memory == decode.BASE_MEMORY + decode.MEMORY_PER_BYTE * (1 << 20)
    assert big.memory - small.memory == decode.MEMORY_PER_BYTE * (255 << 20)
    assert small.cpu_s == decode.BASE_CPU_S + 1 and big.cpu_s == decode.BASE_CPU_S + 256
    assert big.wall_s > big.cpu_s


@pytest.mark.parametrize("in_child", [False, True], ids=["in-process", "child"])
def test_a_legacy_sharded_tensor_metadata_is_decoded_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_child: bool
) -> None:
    """A `.metadata` of torch < 2.2 (sharded_tensor's TensorProperties) drains like any
    other: the daemon's rows are torch's own, and the zstd rewrite keeps the legacy
    properties; a class outside the allow-list beside them is still refused."""
    monkeypatch.setattr(decode, "IN_PROCESS_BYTES", 0 if in_child else 1 << 20)
    raw = save_legacy_checkpoint(tmp_path / "legacy").metadata
    what = f"ns/legacy-{in_child}/.metadata"
    files = data_files(raw, what=what)
    assert {path: f.items for path, f in files.items()} == rows(raw)
    mappings = {
        path: {offset: (offset + 1, length + 2) for offset, length in items}
        for path, items in rows(raw).items()
    }
    rewritten = pickle.loads(rewrite_metadata(raw, mappings, what=what))
    original = pickle.loads(raw)
    assert rewritten.state_dict_metadata == original.state_dict_metadata
    tensors = [e for e in rewritten.state_dict_metadata.values() if hasattr(e, "properties")]
    assert tensors and all(type(e.properties) is LegacyTensorProperties for e in tensors)
    assert all(
        i.transform_descriptors == [ZSTD_DESCRIPTOR] for i in rewritten.storage_data.values()
    )

    planted = dataclasses.replace(original, planner_data=ShardMetadata([0], [4]))
    with pytest.raises(UnsafeMetadata, match=r"legacy-planted.*ShardMetadata"):
        data_files(pickle.dumps(planted), what=f"ns/legacy-planted-{in_child}/.metadata")
