"""Block checksums: xxh3-128 over fixed-size blocks, streaming == one-shot."""

from __future__ import annotations

import array
import random

import pytest
import xxhash
from tierckpt.checksum import (
    ALGORITHM,
    DEFAULT_BLOCK_SIZE,
    DIGEST_SIZE,
    BlockChecksums,
    BlockHasher,
    checksum_bytes,
)
from tierckpt.errors import ChecksumMismatch

MiB = 1 << 20


def _reference(data: bytes, block_size: int) -> bytes:
    """Independent oracle: hash each block slice on its own."""
    return b"".join(
        xxhash.xxh3_128_digest(data[i : i + block_size]) for i in range(0, len(data), block_size)
    )


@pytest.fixture(scope="module")
def data() -> bytes:
    return random.Random(1234).randbytes(3 * MiB + 12345)


def test_defaults() -> None:
    assert MiB == DEFAULT_BLOCK_SIZE
    assert ALGORITHM == "xxh3-128"
    assert DIGEST_SIZE == 16


def test_one_shot_matches_reference(data: bytes) -> None:
    sums = checksum_bytes(data)
    assert sums.block_size == MiB
    assert sums.algorithm == ALGORITHM
    assert sums.digests == _reference(data, MiB)
    assert sums.block_count == 4


@pytest.mark.parametrize("block_size", [MiB, 4096, 1000])
def test_streaming_odd_pieces_equals_one_shot(data: bytes, block_size: int) -> None:
    rng = random.Random(block_size)
    # awkward sizes first (empty, tiny, just under/at/over a block), then random ones
    sizes = [0, 1, 7, block_size - 1, 1, block_size, block_size + 3, 4093, MiB + 17]
    hasher = BlockHasher(block_size)
    pos = 0
    while pos < len(data):
        take = sizes.pop(0) if sizes else rng.randrange(1, 3 * block_size)
        piece = data[pos : pos + take]
        kind = pos % 3  # mix the accepted buffer types
        hasher.update(piece if kind == 0 else bytearray(piece) if kind == 1 else memoryview(piece))
        pos += len(piece)
    assert hasher.size == len(data)
    assert hasher.finish() == checksum_bytes(data, block_size)
    assert hasher.finish().digests == _reference(data, block_size)


def test_update_accepts_multibyte_formats() -> None:
    values = array.array("I", range(100_000))
    hasher = BlockHasher(4096)
    hasher.update(memoryview(values))
    raw = values.tobytes()
    assert hasher.size == len(raw)
    assert hasher.finish().digests == _reference(raw, 4096)


@pytest.mark.parametrize(
    ("size", "blocks"), [(0, 0), (1, 1), (MiB - 1, 1), (MiB, 1), (MiB + 1, 2), (2 * MiB, 2)]
)
def test_block_count(size: int, blocks: int) -> None:
    sums = checksum_bytes(bytes(size))
    assert sums.block_count == blocks
    assert len(sums.digests) == blocks * DIGEST_SIZE
    assert sums.expected_blocks(size) == blocks


def test_empty_input_has_no_digests() -> None:
    hasher = BlockHasher()
    hasher.update(b"")
    assert hasher.finish().digests == b""
    assert hasher.size == 0


def test_finish_is_repeatable_and_does_not_close_the_stream(data: bytes) -> None:
    hasher = BlockHasher(4096)
    hasher.update(data[:5000])
    first = hasher.finish()
    assert first == hasher.finish()
    hasher.update(data[5000:9000])
    assert hasher.finish() == checksum_bytes(data[:9000], 4096)


@pytest.mark.parametrize("flip_at", [0, MiB - 1, MiB, 2 * MiB + 5, 3 * MiB + 12344])
def test_flipped_byte_changes_exactly_one_block(data: bytes, flip_at: int) -> None:
    good = checksum_bytes(data)
    corrupt = bytearray(data)
    corrupt[flip_at] ^= 0x01
    bad = checksum_bytes(corrupt)
    changed = [b for b in range(good.block_count) if good.digest(b) != bad.digest(b)]
    assert changed == [flip_at // MiB]


def test_digest_slices_one_block(data: bytes) -> None:
    sums = checksum_bytes(data)
    for block in range(sums.block_count):
        chunk = data[block * MiB : (block + 1) * MiB]
        assert sums.digest(block) == xxhash.xxh3_128_digest(chunk)


def test_check_block_accepts_the_right_digest_and_names_the_bad_block(data: bytes) -> None:
    sums = checksum_bytes(data)
    sums.check_block(2, xxhash.xxh3_128_digest(data[2 * MiB : 3 * MiB]), what="ns/step-1/f")
    with pytest.raises(ChecksumMismatch) as info:
        sums.check_block(2, sums.digest(1), what="ns/step-1/__0_0.distcp")
    message = str(info.value)
    assert "block 2" in message
    assert "ns/step-1/__0_0.distcp" in message
    assert str(2 * MiB) in message
    assert isinstance(info.value, OSError)


def test_summary_is_stable_and_content_dependent(data: bytes) -> None:
    a = checksum_bytes(data)
    assert a.summary() == checksum_bytes(data).summary()
    assert a.summary() != checksum_bytes(data[:-1] + bytes([data[-1] ^ 1])).summary()
    assert len(a.summary()) == 16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0, "digests": b""},
        {"block_size": -1, "digests": b""},
        {"block_size": 4096, "digests": b"x" * 15},
        {"block_size": 4096, "digests": b"x" * 17},
        {"block_size": 4096, "digests": b"", "algorithm": "crc32"},
    ],
)
def test_malformed_checksums_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        BlockChecksums(**kwargs)  # type: ignore[arg-type]
