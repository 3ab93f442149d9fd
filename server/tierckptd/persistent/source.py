"""The persistent tier as a restore source (`tierckptd.restore.FileSource`).

`PersistentSource.chunks` yields a file's original bytes: `.metadata` is the memory
tier's original one, kept in the bookkeeping area (the stored `.metadata` is rewritten
for the compressed files); a data file is read through its upload marker, each zstd
item decoded back in bounded reads (`readback.original_chunks`). Nothing is installed
here: the restorer verifies every block against the manifest where the bytes land.

Errors at this boundary, as the restore chain expects them:

- `CheckpointNotFound`: the tier has no such object (no marker, no bookkeeping copy of
  `.metadata`, an object gone between the marker and the read);
- `SourceUnavailable(name, cause)`: the tier could not be asked — an outage, a timeout,
  connection refused, 403/AccessDenied (wrong credentials, a bucket policy), throttling,
  or the retry policy giving up; `cause` names the S3 error;
- `ChecksumMismatch`: what is stored is damaged (a frame that does not decode, an
  object shorter than its marker says, an oversized bookkeeping object).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

import xxhash
from tierckpt.checksum import BytesLike
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch, TierckptError
from tierckpt.names import METADATA_FILE

from tierckptd.config_secrets import redact
from tierckptd.errors import SourceUnavailable
from tierckptd.model import FileRecord
from tierckptd.persistent.retry import PersistentTierUnavailable, is_transient
from tierckptd.persistent.store import PersistentTier
from tierckptd.persistent.untrusted import original_chunks

__all__ = ["METADATA_OBJECT", "PersistentSource", "describe_failure"]

METADATA_OBJECT = "metadata.orig"  # the memory tier's (uncompressed) .metadata
MAX_METADATA = 1 << 30  # a bookkeeping .metadata larger than this is refused unread

_CAUSE_LIMIT = 300


def _s3_code(exc: BaseException) -> str:
    """The S3 error code carried by a botocore ClientError (or s3fs's wrapping), if any."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if isinstance(code, str) and code:
            return code
    return ""


def describe_failure(exc: BaseException) -> str:
    """A short cause naming the S3 error: "AccessDenied: ...", "connection refused: ...",
    "timeout: ...", following the exception chain to the first error that says more."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(chain) < 16:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        text = str(e)[:_CAUSE_LIMIT]
        code = _s3_code(e)
        if code:
            return f"{code}: {text}"
        if isinstance(e, PermissionError):
            return f"AccessDenied: {text}"
        if isinstance(e, ConnectionRefusedError) or "refused" in text.lower():
            return f"connection refused: {text}"
        if isinstance(e, ConnectionError) and not isinstance(e, PersistentTierUnavailable):
            return f"connection failed: {text}"
        if isinstance(e, TimeoutError) or type(e).__name__.endswith("TimeoutError"):
            return f"timeout: {text}"
        if isinstance(e, OSError) and e.errno == errno.EBUSY:
            return f"SlowDown (throttled): {text}"
    last = chain[-1]
    return f"{type(last).__name__}: {str(last)[:_CAUSE_LIMIT]}"


def tier_label(url: str) -> str:
    """How errors sent to clients name the persistent tier: an object-store URL without its
    credentials ("persistent s3://bucket/prefix"), but a local filesystem store only by a
    short digest of its URL, since a path on this node is not the caller's business (the
    daemon's log names it in full). Distinct stores keep distinct labels."""
    shown = str(redact(url))
    scheme = shown.split("://", 1)[0] if "://" in shown else "file"
    if scheme in ("file", "local"):
        return f"persistent file store {xxhash.xxh64_hexdigest(url.encode())[:8]}"
    return f"persistent {shown}"


class PersistentSource:
    """Original bytes of committed files from one persistent tier (see the module doc).

    Args:
        tier: the persistent tier.
        catalog: unused; accepted so that ``PersistentSource(tier, catalog)`` keeps working.
    """

    def __init__(self, tier: PersistentTier, catalog: object | None = None) -> None:
        self.tier = tier

    @property
    def name(self) -> str:
        return tier_label(self.tier.url)

    def chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord
    ) -> Iterator[tuple[int, BytesLike]]:
        what = f"{namespace}/{checkpoint_id}/{f.name} in {self.name}"
        try:
            if f.name == METADATA_FILE:
                data = self.tier.read_bookkeeping(
                    namespace, checkpoint_id, METADATA_OBJECT, max_bytes=MAX_METADATA
                )
                if data is None:
                    raise CheckpointNotFound(f"{what}: no original .metadata in the bookkeeping")
                yield 0, data
                return
            marker = self.tier.uploaded(namespace, checkpoint_id).get(f.name)
            if marker is None:
                raise CheckpointNotFound(f"{what}: not in the persistent tier")
            yield from original_chunks(
                self.tier, namespace, checkpoint_id, f.name, marker.index, f.size
            )
        except TierckptError:
            raise  # CheckpointNotFound, ChecksumMismatch (a bad frame): as they are
        except PersistentTierUnavailable as e:
            raise SourceUnavailable(self.name, describe_failure(e)) from e
        except FileNotFoundError as e:
            raise CheckpointNotFound(f"{what}: not in the persistent tier ({e})") from None
        except (EOFError, ValueError) as e:
            # An object shorter than its marker says, an oversized bookkeeping object.
            raise ChecksumMismatch(f"{what}: the stored copy is damaged ({e})") from None
        except Exception as e:
            if isinstance(e, PermissionError) or _s3_code(e) or is_transient(e):
                raise SourceUnavailable(self.name, describe_failure(e)) from e
            raise
