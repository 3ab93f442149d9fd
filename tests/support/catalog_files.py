"""One file of a save written the way a rank does, straight against a `Catalog` (no RPC):
open it (a warm segment or a fresh file), write the bytes in place, commit it with its
block checksums. The unit tests' saves and the in-process source nodes use it."""

from __future__ import annotations

from tierckpt.checksum import checksum_bytes
from tierckptd.catalog import Catalog


def write_file(
    catalog: Catalog,
    namespace: str,
    checkpoint_id: str,
    name: str,
    data: bytes,
    rank: int = 0,
    *,
    block_size: int = 1024,
) -> str:
    """Open, write and commit one file as `rank`; returns its path."""
    path, _prealloc = catalog.open_file(namespace, checkpoint_id, name, rank)
    with open(path, "r+b") as f:  # in place: a recycled segment keeps its pages
        f.write(data)
        f.truncate(len(data))
    cs = checksum_bytes(data, block_size=block_size)
    catalog.commit_file(
        namespace,
        checkpoint_id,
        name,
        rank,
        len(data),
        algorithm=cs.algorithm,
        block_size=cs.block_size,
        digests=cs.digests,
    )
    return path
