"""The persistent tier as a restore source (`tierckptd.restore.FileSource`).

`PersistentSource.chunks` yields a file's original bytes: `.metadata` is the memory
tier's original one, kept in the bookkeeping area (the stored `.metadata` is rewritten
for the compressed files); a data file is read through its upload marker, each zstd
item decoded back in bounded reads (`untrusted.original_chunks`). Nothing is installed
here: the restorer verifies every block against the manifest where the bytes land.

Errors at this boundary, as the restore chain expects them (what a backend's failure
means is its entry in `persistent.errors`):

- `CheckpointNotFound`: the tier has no such object (no marker, no bookkeeping copy of
  `.metadata`, an object gone between the marker and the read);
- `SourceUnavailable(name, cause)`: the tier could not be asked — an outage, a timeout,
  connection refused, 403/AccessDenied (wrong credentials, a bucket policy), throttling,
  or the retry policy giving up; `cause` names the S3 error;
- `ChecksumMismatch`: what is stored is damaged (a frame that does not decode, an
  object shorter than its marker says, an oversized bookkeeping object).
"""

from __future__ import annotations

from collections.abc import Iterator

from tierckpt.checksum import BytesLike
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch, TierckptError
from tierckpt.names import METADATA_FILE

from tierckptd.errors import SourceUnavailable
from tierckptd.model import FileRecord
from tierckptd.persistent.errors import Failure, tier_label
from tierckptd.persistent.store import PersistentTier
from tierckptd.persistent.untrusted import original_chunks

__all__ = ["METADATA_OBJECT", "PersistentSource"]

METADATA_OBJECT = "metadata.orig"  # the memory tier's (uncompressed) .metadata
MAX_METADATA = 1 << 30  # a bookkeeping .metadata larger than this is refused unread


class PersistentSource:
    """Original bytes of committed files from one persistent tier (see the module doc)."""

    def __init__(self, tier: PersistentTier) -> None:
        self.tier = tier

    @property
    def name(self) -> str:
        return tier_label(self.tier.url)

    def chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord
    ) -> Iterator[tuple[int, BytesLike]]:
        what = f"{namespace}/{checkpoint_id}/{f.name} in {self.name}"
        try:
            # A "files" checkpoint's `.metadata` is data with an upload marker; DCP's
            # has none (its original is in the bookkeeping). Either way the bytes are
            # checked against the manifest's checksums where they land.
            marker = self.tier.uploaded(namespace, checkpoint_id).get(f.name)
            if f.name == METADATA_FILE and marker is None:
                data = self.tier.read_bookkeeping(
                    namespace, checkpoint_id, METADATA_OBJECT, max_bytes=MAX_METADATA
                )
                if data is None:
                    raise CheckpointNotFound(f"{what}: no original .metadata in the bookkeeping")
                yield 0, data
                return
            if marker is None:
                raise CheckpointNotFound(f"{what}: not in the persistent tier")
            yield from original_chunks(
                self.tier, namespace, checkpoint_id, f.name, marker.index, f.size
            )
        except TierckptError:
            raise  # CheckpointNotFound, ChecksumMismatch (a bad frame): as they are
        except (EOFError, ValueError) as e:
            # An object shorter than its marker says, an oversized bookkeeping object.
            raise ChecksumMismatch(f"{what}: the stored copy is damaged ({e})") from None
        except Exception as e:
            failure = self.tier.backend.classify(e)
            if failure is Failure.MISSING:
                raise CheckpointNotFound(f"{what}: not in the persistent tier ({e})") from None
            if failure is None:
                raise  # not the store's failure (a bad request, a bug): as it is
            raise SourceUnavailable(self.name, self.tier.backend.describe(e)) from e
