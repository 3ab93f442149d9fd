"""A `FileSource` over another memory tier's catalog (for the conformance suite).

The daemon's `Restorer` reads its own memory tier directly; this source reads a verified
copy that some catalog holds, the way a peer serves one, without gRPC: `chunks` yields
blocks verified against that catalog's manifest, and says NOT_FOUND when the catalog
holds no copy (or the copy vanished), DATA_LOSS when the copy is corrupt and UNAVAILABLE
when the memory dir cannot be read at all.
"""

from __future__ import annotations

from collections.abc import Iterator

from tierckpt.checksum import BytesLike
from tierckpt.errors import CheckpointNotFound, TierckptError
from tierckpt.memory_files import VerifiedFile
from tierckptd.catalog import Catalog
from tierckptd.errors import SourceUnavailable
from tierckptd.model import FileRecord

__all__ = ["MemorySource"]

PIECE_BLOCKS = 4  # blocks per piece, like a peer's FetchFile chunk


class MemorySource:
    """Copies of committed files that `catalog` holds; never installs, never locks."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    @property
    def name(self) -> str:
        return f"memory node {self.catalog.node_id}"

    def chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord
    ) -> Iterator[tuple[int, BytesLike]]:
        what = f"{namespace}/{checkpoint_id}/{f.name} in {self.name}"
        held, path = self.catalog.file_view(namespace, checkpoint_id, f.name)
        if not path:
            raise CheckpointNotFound(f"{what}: not held")
        if (held.size, held.checksums) != (f.size, f.checksums):
            raise CheckpointNotFound(f"{what}: holds other bytes under that name")
        assert held.checksums is not None
        try:
            vf = VerifiedFile(path, held.size, held.checksums, what=what)
        except FileNotFoundError:
            raise CheckpointNotFound(f"{what}: the copy vanished") from None
        except TierckptError:
            raise  # ChecksumMismatch: the copy has another size
        except OSError as e:
            raise SourceUnavailable(self.name, f"cannot read the memory dir: {e}") from None
        with vf:
            step = held.checksums.block_size * PIECE_BLOCKS
            for offset in range(0, held.size, step):
                try:
                    data = vf.read_blocks_bytes(offset, min(step, held.size - offset))
                except TierckptError:
                    raise  # ChecksumMismatch: the copy is corrupt
                except OSError as e:
                    raise SourceUnavailable(self.name, f"cannot read {what}: {e}") from None
                yield offset, data
