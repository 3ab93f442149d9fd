"""parse_saved_tensor: dtype/shape/stride and the storage record offset of a torch.save
archive embedded at an offset of a file; SavedTensorLayout.contiguous_range."""

from __future__ import annotations

import ctypes
import io
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.utils.serialization as serialization
from tierckpt.saved_tensor import SavedTensorLayout, parse_saved_tensor

PREFIX = 777  # odd, so nothing is accidentally aligned
SUFFIX = b"\xee" * 333  # bytes after the item must not be read as part of it


@pytest.fixture(params=[True, False], ids=["crc", "no-crc"])
def crc(request: pytest.FixtureRequest) -> Iterator[bool]:
    config = serialization.config.save
    previous = config.compute_crc32
    config.compute_crc32 = request.param
    try:
        yield request.param
    finally:
        config.compute_crc32 = previous


def _save_blob(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _embed(tmp_path: Path, blob: bytes) -> tuple[Path, int, int]:
    path = tmp_path / "file.distcp"
    path.write_bytes(os.urandom(PREFIX) + blob + SUFFIX)
    return path, PREFIX, len(blob)


def _parse(tmp_path: Path, obj: object) -> tuple[bytes, SavedTensorLayout]:
    path, base, length = _embed(tmp_path, _save_blob(obj))
    fd = os.open(path, os.O_RDONLY)
    try:
        layout = parse_saved_tensor(fd, base, length)
    finally:
        os.close(fd)
    return path.read_bytes()[base : base + length], layout


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def _slice(item: bytes, rng: tuple[int, int] | None) -> bytes:
    assert rng is not None
    start, nbytes = rng
    return item[start : start + nbytes]


def _full(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (0,) * t.dim(), tuple(t.shape)


CONTIGUOUS = {
    "float32": lambda: torch.randn(33, 17),
    "bfloat16": lambda: torch.randn(5, 7, 9).to(torch.bfloat16),
    "int64": lambda: torch.arange(-500, 500, dtype=torch.int64),
    "0-dim": lambda: torch.tensor(3.25, dtype=torch.float64),
    "bool": lambda: torch.rand(100) > 0.5,
    "empty": lambda: torch.zeros(0, 4),
}


@pytest.mark.parametrize("name", CONTIGUOUS)
def test_contiguous_tensor(tmp_path: Path, crc: bool, name: str) -> None:
    t = CONTIGUOUS[name]()
    item, layout = _parse(tmp_path, t)
    meta = layout.meta
    assert meta.device.type == "meta"
    assert meta.dtype == t.dtype
    assert meta.shape == t.shape
    assert meta.stride() == t.stride()
    assert layout.storage_nbytes == t.numel() * t.element_size()
    assert 0 < layout.storage_offset_bytes < len(item)
    rng = layout.contiguous_range(*_full(t))
    assert rng == (layout.storage_offset_bytes, t.numel() * t.element_size())
    assert _slice(item, rng) == _tensor_bytes(t)


def test_non_contiguous_tensor(tmp_path: Path, crc: bool) -> None:
    t = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5).t()
    item, layout = _parse(tmp_path, t)
    assert layout.meta.shape == (5, 12)
    assert layout.meta.stride() == (1, 5)
    assert not layout.meta.is_contiguous()
    assert layout.contiguous_range(*_full(t)) is None
    # the storage record holds the base storage in its own order
    storage = item[layout.storage_offset_bytes : layout.storage_offset_bytes + 12 * 5 * 4]
    assert storage == _tensor_bytes(t.t())


def test_view_with_storage_offset(tmp_path: Path) -> None:
    base = torch.arange(100, dtype=torch.int32)
    t = base[10:30]
    item, layout = _parse(tmp_path, t)
    assert layout.meta.storage_offset() == 10
    assert layout.storage_nbytes == 400  # torch.save keeps the whole storage
    rng = layout.contiguous_range((0,), (20,))
    assert _slice(item, rng) == _tensor_bytes(t)
    assert _slice(item, layout.contiguous_range((5,), (3,))) == _tensor_bytes(t[5:8])


def test_row_slab_and_column_slice(tmp_path: Path) -> None:
    t = torch.randn(8, 16)
    item, layout = _parse(tmp_path, t)
    assert _slice(item, layout.contiguous_range((2, 0), (3, 16))) == _tensor_bytes(t[2:5])
    assert _slice(item, layout.contiguous_range((7, 0), (1, 16))) == _tensor_bytes(t[7:8])
    assert layout.contiguous_range((0, 4), (8, 4)) is None  # a column slice
    assert layout.contiguous_range((0, 0), (8, 15)) is None
    assert layout.contiguous_range((0,), (8,)) is None  # wrong rank


def test_3d_slabs(tmp_path: Path) -> None:
    t = torch.randn(4, 6, 5).to(torch.bfloat16)
    item, layout = _parse(tmp_path, t)
    assert _slice(item, layout.contiguous_range((1, 0, 0), (2, 6, 5))) == _tensor_bytes(t[1:3])
    assert layout.contiguous_range((0, 1, 0), (4, 2, 5)) is None  # rows of every matrix
    assert layout.contiguous_range((0, 0, 1), (4, 6, 2)) is None


def test_partial_inner_runs_are_contiguous(tmp_path: Path) -> None:
    t = torch.randn(4, 6, 5)
    item, layout = _parse(tmp_path, t)
    assert _slice(item, layout.contiguous_range((1, 2, 0), (1, 3, 5))) == _tensor_bytes(t[1, 2:5])
    assert _slice(item, layout.contiguous_range((1, 2, 1), (1, 1, 3))) == _tensor_bytes(
        t[1, 2, 1:4]
    )


def test_parse_rejects_a_non_tensor_item(tmp_path: Path) -> None:
    path, base, length = _embed(tmp_path, _save_blob({"a": torch.zeros(2)}))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="expected a saved tensor"):
            parse_saved_tensor(fd, base, length)
    finally:
        os.close(fd)


def test_parse_reads_only_the_framing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(1 << 20)  # 4 MiB of data, a few KiB of framing
    path, base, length = _embed(tmp_path, _save_blob(t))
    real_preadv, seen = os.preadv, []

    def counting_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        got = real_preadv(fd, buffers, offset)
        seen.append((offset, got))
        return got

    real_pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        got = real_pread(fd, n, offset)
        seen.append((offset, len(got)))
        return got

    monkeypatch.setattr(os, "preadv", counting_preadv)
    monkeypatch.setattr(os, "pread", counting_pread)
    fd = os.open(path, os.O_RDONLY)
    try:
        layout = parse_saved_tensor(fd, base, length)
    finally:
        os.close(fd)
    assert layout.meta.shape == t.shape
    assert seen and all(base <= off and off + got <= base + length for off, got in seen)
    assert sum(got for _, got in seen) < (1 << 20)


def test_items_sharing_a_pickle_parse_to_their_own_offsets(tmp_path: Path) -> None:
    # A DCP file holds many same-shape items: the meta result is reused per exact pickle
    # bytes, so each item's own storage offset and a different shape/dtype must still show.
    tensors = [torch.randn(300, 7) for _ in range(3)] + [torch.randn(7, 300)]
    tensors += [torch.randn(300, 7).double(), torch.randn(300, 7)[:, 1:]]
    blobs = [_save_blob(t) for t in tensors]
    path = tmp_path / "file.distcp"
    offsets, cursor = [], PREFIX
    for b in blobs:
        offsets.append(cursor)
        cursor += len(b) + 13
    path.write_bytes(os.urandom(PREFIX) + b"".join(b + os.urandom(13) for b in blobs) + SUFFIX)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(2):  # the second round is served from the remembered results
            for t, blob, base in zip(tensors, blobs, offsets, strict=True):
                layout = parse_saved_tensor(fd, base, len(blob))
                assert (layout.meta.dtype, layout.meta.shape) == (t.dtype, t.shape)
                assert layout.meta.stride() == t.stride()
                if t.is_contiguous():
                    rng = layout.contiguous_range(*_full(t))
                    assert _slice(blob, rng) == _tensor_bytes(t)
                else:
                    assert layout.contiguous_range(*_full(t)) is None
    finally:
        os.close(fd)


def test_crc_off_blob_is_readable_by_plain_torch_load(tmp_path: Path) -> None:
    config = serialization.config.save
    previous = config.compute_crc32
    t = torch.randn(64, 3)
    config.compute_crc32 = False
    try:
        blob = _save_blob({"t": t, "n": 5})
    finally:
        config.compute_crc32 = previous
    assert config.compute_crc32 == previous
    # the setting took effect: the zip entries carry no CRC
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        assert all(info.CRC == 0 for info in archive.infolist())
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    assert torch.equal(loaded["t"], t)
    assert loaded["n"] == 5
    path = tmp_path / "item.pt"
    path.write_bytes(blob)
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert torch.equal(loaded["t"], t)
