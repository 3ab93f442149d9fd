"""Per-item zstd framing: a stock FileSystemReader loads what compress + rewrite produce."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
import zstandard
from tierckpt.errors import ChecksumMismatch, UnsafeMetadata
from tierckptd.persistent.format import (
    ZSTD_DESCRIPTOR,
    BytesSource,
    compress_items,
    data_files,
    rewrite_metadata,
)

from tests.support.dcp_files import (
    SavedCheckpoint,
    assert_state_equal,
    load_target,
    save_checkpoint,
    save_two_rank_checkpoint,
)


def drain_locally(saved_dir: Path, out_dir: Path, verified: bool = True) -> None:
    saved = SavedCheckpoint(saved_dir, {})
    out_dir.mkdir()
    mappings = {}
    for name, data_file in data_files(saved.metadata).items():
        src = saved.verified(name) if verified else BytesSource(saved.data(name))
        with (out_dir / name).open("wb") as out:
            mappings[name] = compress_items(src, data_file.items, out, level=3)
    (out_dir / ".metadata").write_bytes(rewrite_metadata(saved.metadata, mappings))


@pytest.mark.parametrize("two_rank", [False, True])
def test_stock_reader_loads_compressed_copy(tmp_path: Path, two_rank: bool) -> None:
    if two_rank:
        saved = save_two_rank_checkpoint(tmp_path / "hot")
    else:
        saved = save_checkpoint(tmp_path / "hot")
    drain_locally(saved.directory, tmp_path / "cold")

    md = pickle.loads((tmp_path / "cold" / ".metadata").read_bytes())
    assert {i.relative_path for i in md.storage_data.values()} == set(saved.data_names)
    for info in md.storage_data.values():
        assert info.transform_descriptors == [ZSTD_DESCRIPTOR]
        blob = (tmp_path / "cold" / info.relative_path).read_bytes()
        assert blob[info.offset : info.offset + 4] == b"\x28\xb5\x2f\xfd"  # a zstd frame

    target = load_target(saved.state)
    with pytest.raises(AssertionError):
        assert_state_equal(actual=target, expected=saved.state)
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "cold")))
    assert_state_equal(actual=target, expected=saved.state)


def test_each_item_is_one_frame_of_its_bytes(tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot", thread_count=2)
    assert saved.data_names == ["__0_0.distcp", "__0_1.distcp"]
    for name, data_file in data_files(saved.metadata).items():
        raw = saved.data(name)
        out = io.BytesIO()
        index = compress_items(saved.verified(name), data_file.items, out, level=1, chunk_size=999)
        assert sorted(index) == [offset for offset, _ in data_file.items]
        blob = out.getvalue()
        assert sum(n for _, n in index.values()) == len(blob)
        for offset, length in data_file.items:
            new_offset, new_length = index[offset]
            frame = blob[new_offset : new_offset + new_length]
            assert zstandard.ZstdDecompressor().decompress(frame) == raw[offset : offset + length]
        again = io.BytesIO()
        compress_items(BytesSource(raw), data_file.items, again, level=1)
        assert again.getvalue() == blob  # deterministic: a retried upload rewrites the same bytes


def test_corrupt_source_is_refused(tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    name = saved.data_names[0]
    verified = saved.verified(name)  # checksums of the good bytes
    path = saved.directory / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with verified, pytest.raises(ChecksumMismatch):
        compress_items(verified, data_files(saved.metadata)[name].items, io.BytesIO())


def test_rewrite_without_mappings_is_verbatim_and_checks_index(tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    assert rewrite_metadata(saved.metadata, {}) == saved.metadata
    with pytest.raises(ValueError, match="no compressed frame"):
        rewrite_metadata(saved.metadata, {"__0_0.distcp": {}})


def test_bad_items_are_refused() -> None:
    src = BytesSource(b"x" * 100)
    with pytest.raises(ValueError, match="outside"):
        compress_items(src, [(90, 20)], io.BytesIO())
    with pytest.raises(ValueError, match="overlaps"):
        compress_items(src, [(0, 50), (40, 10)], io.BytesIO())


class _Shell:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


def test_metadata_is_decoded_with_the_allow_list_never_unpickled(tmp_path: Path) -> None:
    """C1: the drain's two readers of `.metadata` refuse a pickle payload without running
    it; a rewrite re-pickles what DCP reads back."""
    marker = tmp_path / "MARKER"
    hostile = pickle.dumps(_Shell(f"touch {shlex.quote(str(marker))}"))
    with pytest.raises(UnsafeMetadata, match=r"ns/step-1/\.metadata.*posix\.system"):
        data_files(hostile, what="ns/step-1/.metadata")
    with pytest.raises(UnsafeMetadata):
        rewrite_metadata(hostile, {"__0_0.distcp": {0: (0, 1)}})
    assert not marker.exists()
    saved = save_checkpoint(tmp_path / "hot")
    md = pickle.loads(saved.metadata)
    md.storage_data = {
        k: dataclasses.replace(v, relative_path="../escape") for k, v in md.storage_data.items()
    }
    with pytest.raises(UnsafeMetadata, match="escape"):
        data_files(pickle.dumps(md))
