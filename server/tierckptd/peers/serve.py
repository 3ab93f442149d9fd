"""What this node serves its peers: its holdings of a checkpoint, and verified pieces of a
file it holds (`rpc/peer_service.py` puts them on the wire)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tierckpt.errors import CheckpointNotFound, ChecksumMismatch, InvalidArgument
from tierckpt.memory_files import VerifiedFile

from tierckptd.catalog import Catalog
from tierckptd.model import FileRecord, State

__all__ = ["FIRST_MESSAGE", "MESSAGE_BYTES", "READ_BYTES", "Served", "Serving"]

# Bytes per FetchFile message at most: the fetcher counts any message as progress
# (peers/client.py FETCH_STALL), so a slow link must carry only this much within its
# stall window (1 MiB in 10 s: 0.9 Mbit/s). The first data message is smaller, so that
# even a very slow link shows bytes flowing at once (a "too slow" error, not "no answer").
MESSAGE_BYTES = 1 << 20
FIRST_MESSAGE = 64 << 10
# Bytes read and verified at once (whole checksum blocks, at least one), then sent in
# messages of MESSAGE_BYTES.
READ_BYTES = 4 << 20

OnCorrupt = Callable[[str, str, str, str, str], None]
"""(namespace, checkpoint_id, name, reason, where): a local copy failed verification."""


@dataclass(frozen=True)
class Served:
    """One FetchFile answer: the file's record, then its verified (offset, data) pieces."""

    file: FileRecord
    pieces: Iterator[tuple[int, bytes]]


class Serving:
    """The serving half of the peer tier for one catalog."""

    def __init__(self, catalog: Catalog, on_corrupt: OnCorrupt) -> None:
        self.catalog = catalog
        self.node_id = catalog.node_id
        self.on_corrupt = on_corrupt

    def holdings(self, namespace: str, checkpoint_id: str) -> tuple[State | None, list[FileRecord]]:
        """The checkpoint's state here (None: unknown) and the files held here."""
        return self.catalog.holdings(namespace, checkpoint_id)

    def serve(
        self, namespace: str, checkpoint_id: str, name: str, offset: int, length: int
    ) -> Served:
        """A held file's bytes `offset`..`offset+length` (0: to the end), verified as read
        (READ_BYTES of whole blocks at a time), in pieces of MESSAGE_BYTES at most (the
        first FIRST_MESSAGE); a corrupt copy raises ChecksumMismatch
        (DATA_LOSS for the fetcher) and is dropped and repaired here."""
        f, path = self.catalog.file_view(namespace, checkpoint_id, name)
        what = f"{namespace}/{checkpoint_id}/{name} on node {self.node_id}"
        if not path:
            raise CheckpointNotFound(
                f"node {self.node_id} holds no copy of {namespace}/{checkpoint_id}/{name}"
            )
        if f.checksums is None:
            raise CheckpointNotFound(f"{what}: no checksums recorded")
        end = f.size if length == 0 else offset + length
        if offset < 0 or offset > f.size or end > f.size:
            raise InvalidArgument(f"range {offset}..{end} outside {name}'s {f.size} bytes")
        return Served(f, self._pieces(namespace, checkpoint_id, f, path, offset, end))

    def grantable(
        self, namespace: str, checkpoint_id: str, name: str, offset: int, length: int
    ) -> tuple[FileRecord, int]:
        """A held file's record and the length of its range `offset`..`offset+length`
        (0: to the end), checked as `serve` checks it, for a bulk grant (`bulk_grants`)."""
        f, path = self.catalog.file_view(namespace, checkpoint_id, name)
        if not path:
            raise CheckpointNotFound(
                f"node {self.node_id} holds no copy of {namespace}/{checkpoint_id}/{name}"
            )
        if f.checksums is None:
            raise CheckpointNotFound(f"{namespace}/{checkpoint_id}/{name}: no checksums recorded")
        end = f.size if length == 0 else offset + length
        if offset < 0 or offset > f.size or end > f.size:
            raise InvalidArgument(f"range {offset}..{end} outside {name}'s {f.size} bytes")
        return f, end - offset

    def _pieces(
        self, namespace: str, checkpoint_id: str, f: FileRecord, path: str, offset: int, end: int
    ) -> Iterator[tuple[int, bytes]]:
        assert f.checksums is not None
        step = f.checksums.block_size
        what = f"{namespace}/{checkpoint_id}/{f.name} on node {self.node_id}"
        blocks = max(1, READ_BYTES // step)
        first = True
        try:
            with VerifiedFile(path, f.size, f.checksums, what=what) as vf:
                pos = offset
                while pos < end:
                    n = min((pos // step + blocks) * step, end) - pos
                    data = vf.read_blocks_bytes(pos, n)
                    at = 0
                    while at < n:
                        size = min(FIRST_MESSAGE if first else MESSAGE_BYTES, n - at)
                        yield pos + at, data if size == n else data[at : at + size]
                        first = False
                        at += size
                    pos += n
        except ChecksumMismatch as e:
            self.on_corrupt(namespace, checkpoint_id, f.name, str(e), "served")
            raise
        except FileNotFoundError:
            raise CheckpointNotFound(f"{what}: the copy vanished (evicted)") from None
