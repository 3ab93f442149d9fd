"""ChecksummingWriter (coalescing, hashing, truncating write stream) and VerifiedFile
(ranged reads that verify every block they touch)."""

from __future__ import annotations

import io
import os
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tierckpt.checksum import BlockChecksums, checksum_bytes
from tierckpt.errors import ChecksumMismatch
from tierckpt.memory_files import ChecksummingWriter, VerifiedFile, wait_all

MiB = 1 << 20
SMALL = 256 << 10  # the writer's coalescing threshold


# --- ChecksummingWriter ------------------------------------------------------------------
def _write_through(path: Path, pieces: list[bytes | bytearray | memoryview], **kw: int):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)  # no O_TRUNC, like the storage writer
    try:
        w = ChecksummingWriter(fd, **kw)
        position = 0
        for piece in pieces:
            assert w.write(piece) == memoryview(piece).nbytes
            position += memoryview(piece).nbytes
            assert w.tell() == position
        return w.finish()
    finally:
        os.close(fd)


def _mixed_pieces(rng: random.Random) -> list[bytes]:
    sizes = [1, 0, 17, 300, SMALL - 1, 5, SMALL, 3 * MiB + 5, 2, 4096, MiB, 1, SMALL + 1]
    sizes += [rng.randrange(1, 2000) for _ in range(300)]
    sizes += [2 * MiB - 3, 9]
    return [rng.randbytes(n) for n in sizes]


@pytest.mark.parametrize("block_size", [MiB, 4096])
def test_writer_overwrites_a_longer_recycled_segment(tmp_path: Path, block_size: int) -> None:
    rng = random.Random(block_size)
    pieces = _mixed_pieces(rng)
    expected = b"".join(pieces)
    path = tmp_path / "segment"
    path.write_bytes(b"\xab" * (len(expected) + 3 * MiB + 7))  # stale bytes past the end

    size, sums = _write_through(path, pieces, block_size=block_size)

    assert size == len(expected)
    assert os.path.getsize(path) == len(expected)
    assert path.read_bytes() == expected
    assert sums == checksum_bytes(expected, block_size)


def test_writer_into_an_empty_file_and_buffer_types(tmp_path: Path) -> None:
    rng = random.Random(7)
    raw = [rng.randbytes(n) for n in (10, SMALL * 2, 3, MiB + 1)]
    pieces: list[bytes | bytearray | memoryview] = [
        raw[0],
        bytearray(raw[1]),
        memoryview(raw[2]),
        memoryview(torch.frombuffer(bytearray(raw[3][:-1]), dtype=torch.int16).numpy()),
    ]
    expected = b"".join(raw)[:-1]
    path = tmp_path / "empty"
    path.touch()
    size, sums = _write_through(path, pieces)
    assert path.read_bytes() == expected
    assert (size, sums) == (len(expected), checksum_bytes(expected))


def test_writer_with_nothing_written_truncates_to_zero(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    path.write_bytes(b"old" * 1000)
    size, sums = _write_through(path, [])
    assert size == 0
    assert sums.block_count == 0
    assert os.path.getsize(path) == 0


def test_small_writes_are_coalesced(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        w = ChecksummingWriter(fd)
        for _ in range(100):
            w.write(b"0123456789")
        assert os.path.getsize(path) == 0  # still in the buffer
        w.flush()
        assert os.path.getsize(path) == 1000
        w.write(b"x" * (SMALL + 1))  # a large write flushes first, then goes straight out
        assert os.path.getsize(path) == 1000 + SMALL + 1
        assert w.finish()[0] == 1000 + SMALL + 1
    finally:
        os.close(fd)


def test_close_flushes_but_leaves_the_descriptor_open(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        w = ChecksummingWriter(fd)
        assert w.writable() and not w.seekable() and w.fileno() == fd
        w.write(b"abc")
        w.close()
        assert path.read_bytes() == b"abc"
        os.fstat(fd)  # still open
    finally:
        os.close(fd)


def test_torch_save_through_the_writer_loads_back(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 1000), "b": torch.arange(10), "step": 3}
    path = tmp_path / "item"
    path.write_bytes(b"\xff" * (4 * MiB))
    fd = os.open(path, os.O_WRONLY)
    try:
        w = ChecksummingWriter(fd)
        torch.save(state, w)
        size, sums = w.finish()
    finally:
        os.close(fd)
    blob = path.read_bytes()
    assert size == len(blob)
    assert sums == checksum_bytes(blob)
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    assert torch.equal(loaded["w"], state["w"])
    assert torch.equal(loaded["b"], state["b"])
    assert loaded["step"] == 3


# --- VerifiedFile --------------------------------------------------------------------------
BS = 4096  # small blocks: many blocks (and the pool path) for little data
SIZE = 40 * BS + 123


@pytest.fixture(scope="module")
def content() -> bytes:
    return random.Random(99).randbytes(SIZE)


@pytest.fixture
def stored(tmp_path: Path, content: bytes) -> tuple[Path, BlockChecksums]:
    path = tmp_path / "file"
    path.write_bytes(content)
    return path, checksum_bytes(content, BS)


@pytest.fixture(params=[False, True], ids=["serial", "pool"])
def pool(request: pytest.FixtureRequest) -> Iterator[ThreadPoolExecutor | None]:
    if not request.param:
        yield None
        return
    with ThreadPoolExecutor(4) as executor:
        yield executor


def _ranges(rng: random.Random) -> list[tuple[int, int]]:
    fixed = [
        (0, 0),
        (SIZE, 0),
        (0, SIZE),
        (0, 1),
        (SIZE - 1, 1),
        (BS - 1, 2),
        (BS, BS),
        (BS - 1, BS + 2),
        (3, 5 * BS),
        (7 * BS + 11, 25 * BS),  # >= 16 blocks: the pool path
        (40 * BS, 123),
    ]
    randoms = []
    for _ in range(30):
        start = rng.randrange(SIZE)
        randoms.append((start, rng.randrange(SIZE - start + 1)))
    return fixed + randoms


def _read(f: VerifiedFile, start: int, length: int, pool: ThreadPoolExecutor | None) -> bytes:
    out = bytearray(length)
    f.read_segments([(start, memoryview(out))], pool)
    return bytes(out)


def test_ranges_read_correctly(stored, content: bytes, pool) -> None:
    path, sums = stored
    with VerifiedFile(str(path), SIZE, sums, what="ns/1/f") as f:
        for start, length in _ranges(random.Random(5)):
            assert _read(f, start, length, pool) == content[start : start + length]
            assert bytes(f.read(start, length)) == content[start : start + length]
        # again, now from the verified-block cache
        for start, length in _ranges(random.Random(6)):
            assert _read(f, start, length, pool) == content[start : start + length]


def test_default_block_size_file(tmp_path: Path, pool) -> None:
    data = random.Random(3).randbytes(20 * MiB + 5)
    path = tmp_path / "big"
    path.write_bytes(data)
    with VerifiedFile(str(path), len(data), checksum_bytes(data), what="big") as f:
        assert _read(f, 0, len(data), pool) == data
        assert _read(f, MiB - 10, 18 * MiB, pool) == data[MiB - 10 : 19 * MiB - 10]


def test_read_segments_fills_disjoint_unsorted_segments(stored, content: bytes, pool) -> None:
    path, sums = stored
    segments = [
        (30 * BS + 5, 100),
        (10, 20),
        (40, 60),  # same block as the previous one, with a gap between
        (BS - 3, 6),
        (5 * BS, 0),
        (12 * BS, 17 * BS + 1),
        (SIZE - 7, 7),
    ]
    buffers = [bytearray(n) for _, n in segments]
    with VerifiedFile(str(path), SIZE, sums, what="f") as f:
        f.read_segments(
            [(off, memoryview(b)) for (off, _), b in zip(segments, buffers, strict=True)], pool
        )
    for (off, n), buf in zip(segments, buffers, strict=True):
        assert bytes(buf) == content[off : off + n]


def test_read_segments_into_views_of_one_buffer_and_typed_views(stored, content: bytes) -> None:
    path, sums = stored
    out = bytearray(3000)
    view = memoryview(out)
    floats = torch.zeros(256, dtype=torch.float32)
    with VerifiedFile(str(path), SIZE, sums, what="f") as f:
        f.read_segments([(BS * 9, view[1000:3000]), (BS * 2, view[:1000])])
        f.read_segments([(BS * 20 + 1, memoryview(floats.numpy()))])
    assert bytes(out) == content[BS * 2 : BS * 2 + 1000] + content[BS * 9 : BS * 9 + 2000]
    assert floats.numpy().tobytes() == content[BS * 20 + 1 : BS * 20 + 1 + 1024]


@pytest.mark.parametrize("bad_block", [0, 7, 40])
def test_corrupt_block_fails_only_ranges_touching_it(
    stored, content: bytes, pool, bad_block: int
) -> None:
    path, sums = stored
    flip = bad_block * BS + (5 if bad_block < 40 else 100)
    with open(path, "r+b") as fh:
        fh.seek(flip)
        fh.write(bytes([content[flip] ^ 0x40]))
    lo, hi = bad_block * BS, min((bad_block + 1) * BS, SIZE)

    touching = [(lo, 1), (hi - 1, 1), (flip, 1), (lo - 1 if lo else 0, 2), (0, SIZE)]
    touching.append((max(0, lo - 20 * BS), 22 * BS if lo else 20 * BS))  # pool-sized
    for start, length in touching:
        with VerifiedFile(str(path), SIZE, sums, what="ns/step-9/__0_0.distcp") as f:
            with pytest.raises(ChecksumMismatch, match=f"block {bad_block}\\b") as info:
                _read(f, start, min(length, SIZE - start), pool)
            assert "ns/step-9/__0_0.distcp" in str(info.value)

    with VerifiedFile(str(path), SIZE, sums, what="f") as f:
        clean = [(0, lo), (hi, SIZE - hi)]  # everything before and after the block
        clean += [(lo - 10, 10), (hi, 10)] if lo > 0 and hi < SIZE else []
        for start, length in clean:
            if length and start + length <= SIZE:
                assert _read(f, start, length, pool) == content[start : start + length]
        # one bad segment spoils a multi-segment read
        with pytest.raises(ChecksumMismatch):
            f.read_segments(
                [(0 if lo else hi, memoryview(bytearray(4))), (flip, memoryview(bytearray(1)))],
                pool,
            )


def test_corruption_is_detected_by_a_fresh_open_even_after_a_clean_read(stored) -> None:
    path, sums = stored
    with VerifiedFile(str(path), SIZE, sums, what="f") as f:
        f.read(0, SIZE)
    with open(path, "r+b") as fh:
        fh.seek(3 * BS)
        fh.write(b"\x00\x01\x02")
    with VerifiedFile(str(path), SIZE, sums, what="f") as f, pytest.raises(ChecksumMismatch):
        f.read(3 * BS, 1)


def test_size_mismatch_at_open_raises(stored) -> None:
    path, sums = stored
    with pytest.raises(ChecksumMismatch, match=f"{SIZE} bytes.*says {SIZE - 1}"):
        VerifiedFile(str(path), SIZE - 1, checksum_bytes(b"x" * (SIZE - 1), BS), what="f")
    with open(path, "ab") as fh:
        fh.write(b"!")
    with pytest.raises(ChecksumMismatch, match="f:"):
        VerifiedFile(str(path), SIZE, sums, what="f")


def test_checksum_count_mismatch_at_open_raises(stored) -> None:
    path, sums = stored
    with pytest.raises(ValueError, match="block checksums"):
        VerifiedFile(str(path), SIZE, BlockChecksums(BS, sums.digests[:-16]), what="f")
    with pytest.raises(ValueError, match="block checksums"):
        VerifiedFile(str(path), SIZE, BlockChecksums(BS * 2, sums.digests), what="f")


def test_out_of_range_reads_raise(stored) -> None:
    path, sums = stored
    with VerifiedFile(str(path), SIZE, sums, what="f") as f:
        for start, length in [(SIZE - 1, 2), (-1, 1), (SIZE, 1), (0, SIZE + 1)]:
            with pytest.raises(ValueError, match="outside"):
                f.read(start, length)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.touch()
    with VerifiedFile(str(path), 0, checksum_bytes(b""), what="f") as f:
        assert f.read(0, 0) == bytearray()


def test_short_reads_are_completed(stored, content: bytes, monkeypatch) -> None:
    path, sums = stored
    real_preadv = os.preadv

    def stingy_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        budget, cut = 777, []
        for b in buffers:
            if budget <= 0:
                break
            cut.append(b[:budget])
            budget -= len(cut[-1])
        return real_preadv(fd, cut, offset)

    monkeypatch.setattr(os, "preadv", stingy_preadv)
    with VerifiedFile(str(path), SIZE, sums, what="f") as f:
        assert bytes(f.read(BS - 500, 3 * BS)) == content[BS - 500 : 4 * BS - 500]
        assert bytes(f.read(BS - 500, 3 * BS)) == content[BS - 500 : 4 * BS - 500]  # cached


@pytest.mark.timeout(20)
def test_file_truncated_after_open_raises_instead_of_spinning(stored) -> None:
    path, sums = stored
    with VerifiedFile(str(path), SIZE, sums, what="f") as f:
        os.truncate(path, 10 * BS)
        with pytest.raises(OSError, match="unexpected end of file"):
            f.read(20 * BS, 10)


# --- batched reads: whole blocks straight into buffers, shared edge blocks read once -----
def test_start_segments_batch_of_adjacent_items_with_shared_blocks(tmp_path: Path) -> None:
    # Items laid end to end as in a DCP file: framing (scratch) + data per item, item
    # boundaries inside blocks, one batch for all of them, several tasks on the pool.
    data = random.Random(11).randbytes(9 * MiB + 333)
    path = tmp_path / "items"
    path.write_bytes(data)
    cuts = [0, 700, MiB + 5, 4 * MiB - 1, 4 * MiB + 900, 8 * MiB, len(data)]
    outs = [bytearray(b - a) for a, b in zip(cuts, cuts[1:], strict=False)]
    sums = checksum_bytes(data)
    with VerifiedFile(str(path), len(data), sums, what="f") as f, ThreadPoolExecutor(2) as pool:
        jobs = f.start_segments(
            [(a, memoryview(o)) for a, o in zip(cuts, outs, strict=False)], pool
        )
        assert len(jobs) > 2
        wait_all(jobs)
    assert b"".join(outs) == data


def test_start_segments_reports_a_corrupt_interior_block_after_every_job_ended(
    tmp_path: Path,
) -> None:
    data = random.Random(12).randbytes(12 * MiB)
    path = tmp_path / "bad"
    path.write_bytes(data)
    sums = checksum_bytes(data)
    with open(path, "r+b") as fh:
        fh.seek(7 * MiB + 77)
        fh.write(bytes([data[7 * MiB + 77] ^ 1]))
    out = bytearray(len(data) - 10)
    with VerifiedFile(str(path), len(data), sums, what="ns/1/f") as f:
        with ThreadPoolExecutor(2) as executor:
            jobs = f.start_segments([(10, memoryview(out))], executor)
            with pytest.raises(ChecksumMismatch, match="ns/1/f, block 7\\b"):
                wait_all(jobs)
            assert all(j.done() for j in jobs)  # no worker still writes into `out`
        with pytest.raises(ChecksumMismatch, match="block 7\\b"):  # not cached as good
            f.read(7 * MiB, 1)


def test_wait_all_cancels_what_has_not_started_and_raises_the_first_error() -> None:
    def boom() -> None:
        raise RuntimeError("first")

    with ThreadPoolExecutor(1) as executor:
        gate = threading.Event()
        blocker = executor.submit(gate.wait, 5)
        failing = executor.submit(boom)
        later = executor.submit(lambda: None)
        gate.set()
        with pytest.raises(RuntimeError, match="first"):
            wait_all([blocker, failing, later])  # type: ignore[list-item]
        assert blocker.done() and failing.done() and later.done()


def test_overlapping_segments_are_refused(stored) -> None:
    path, sums = stored
    with (
        VerifiedFile(str(path), SIZE, sums, what="f") as f,
        pytest.raises(ValueError, match="overlap"),
    ):
        f.read_segments([(0, memoryview(bytearray(10))), (5, memoryview(bytearray(10)))])


def test_whole_file_read_with_the_pool_uses_the_fast_path_and_verifies(stored, content) -> None:
    path, sums = stored
    with VerifiedFile(str(path), SIZE, sums, what="f") as f, ThreadPoolExecutor(3) as executor:
        out = bytearray(SIZE)
        f.read_segments([(0, memoryview(out))], executor)  # the short last block included
        assert bytes(out) == content
