"""How PersistentSource turns the persistent tier's failures, as its backend's table
(`persistent.errors`) reads them, into the restore chain's errors: missing ->
CheckpointNotFound, unreachable or refused (403) -> SourceUnavailable naming the S3
error, damaged -> ChecksumMismatch. A real `file://` tier with one method replaced by a
failing one (the S3 errors themselves are in the integration tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch
from tierckptd.errors import SourceUnavailable
from tierckptd.model import FileRecord
from tierckptd.persistent.errors import (
    BACKENDS,
    GENERIC,
    QUIET_LOGGERS,
    S3,
    PersistentTierUnavailable,
    backend_for,
    tier_label,
)
from tierckptd.persistent.markers import UploadedFile
from tierckptd.persistent.source import PersistentSource
from tierckptd.persistent.store import PersistentTier, RetryPolicy

NS, CID = "run9", "step-000001"
S3_URL = "s3://bucket/prefix"  # never reached: the methods that would ask it fail first
FAST = RetryPolicy(max_attempts=2, deadline=None, base=0.01, cap=0.02)


class ClientError(Exception):
    """Shaped like botocore's: the S3 error code in `response`."""

    def __init__(self, code: str) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code, "Message": "..."}}


def _record(name: str, data: bytes) -> FileRecord:
    return FileRecord(name=name, size=len(data), checksums=checksum_bytes(data), rank=0)


def _source(tmp_path: Path, url: str = "", **failing: Any) -> PersistentSource:
    """A tier on `url` (a `file://` root by default) whose `failing` methods raise."""
    tier = PersistentTier(url or f"file://{tmp_path / 'store'}", retry=FAST, compression="none")
    for method, exc in failing.items():

        def fail(*args: Any, _exc: BaseException = exc, **kwargs: Any) -> Any:
            raise _exc

        setattr(tier, method, fail)
    return PersistentSource(tier)


def _drain(source: PersistentSource, f: FileRecord) -> bytes:
    return b"".join(bytes(d) for _, d in source.chunks(NS, CID, f))


def test_name_never_shows_a_local_path_and_tells_stores_apart(tmp_path: Path) -> None:
    one = PersistentSource(PersistentTier(f"file://{tmp_path / 'one'}")).name
    two = PersistentSource(PersistentTier(f"file://{tmp_path / 'two'}")).name
    assert one.startswith("persistent file store ") and str(tmp_path) not in one
    assert one != two


def test_name_shows_an_object_store_url_without_credentials() -> None:
    name = tier_label("s3://user:secret@bucket/prefix")
    assert name.startswith("persistent s3://") and "secret" not in name and "bucket/prefix" in name


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (PermissionError(13, "Access Denied"), "AccessDenied"),
        (ClientError("InvalidAccessKeyId"), "InvalidAccessKeyId"),
        (PersistentTierUnavailable("gave up"), "PersistentTierUnavailable"),
        (ConnectionRefusedError(111, "Connection refused"), "connection refused"),
        (ClientError("SomethingNew"), "SomethingNew"),
    ],
)
def test_an_unreachable_or_refusing_tier_is_unavailable(
    tmp_path: Path, error: BaseException, cause: str
) -> None:
    # An S3 tier, never asked: its methods fail as s3fs and botocore do.
    source = _source(tmp_path, S3_URL, uploaded=error, read_bookkeeping=error)
    for f in (_record("__0_0.distcp", b"x"), _record(".metadata", b"m")):
        with pytest.raises(SourceUnavailable) as caught:
            _drain(source, f)
        assert caught.value.source == source.name
        assert cause in caught.value.cause


def test_the_cause_follows_the_chain_to_the_s3_error() -> None:
    try:
        try:
            raise ClientError("AccessDenied")
        except ClientError as inner:
            raise PersistentTierUnavailable("read failed 4 times") from inner
    except PersistentTierUnavailable as e:
        assert S3.describe(e).startswith("AccessDenied")


def test_missing_is_not_found_and_damaged_is_a_mismatch(tmp_path: Path) -> None:
    source = _source(tmp_path)
    with pytest.raises(CheckpointNotFound):
        _drain(source, _record("__0_0.distcp", b"x"))
    with pytest.raises(CheckpointNotFound):
        _drain(source, _record(".metadata", b"m"))
    data = b"0123456789"
    marker = UploadedFile(
        name="__0_0.distcp", source_size=len(data), size=len(data), compression="none"
    )
    tier = source.tier
    tier.uploaded = lambda *_: {"__0_0.distcp": marker}  # type: ignore[method-assign]
    stored = tmp_path / "store" / NS / CID / "__0_0.distcp"
    stored.parent.mkdir(parents=True)
    stored.write_bytes(data[:5])  # shorter than its marker says
    with pytest.raises(ChecksumMismatch):
        _drain(source, _record("__0_0.distcp", data))


@pytest.mark.parametrize(
    ("error", "found"),
    [
        (FileNotFoundError(2, "gone"), CheckpointNotFound),
        (ClientError("NoSuchKey"), CheckpointNotFound),  # untranslated: its code says so
        (FileExistsError(17, "a request's fault"), FileExistsError),  # not the store's
        (RuntimeError("a bug"), RuntimeError),
    ],
)
def test_what_is_not_an_outage_is_not_reported_as_one(
    tmp_path: Path, error: BaseException, found: type[BaseException]
) -> None:
    source = _source(tmp_path, S3_URL, uploaded=error)
    with pytest.raises(found):
        _drain(source, _record("__0_0.distcp", b"x"))


def test_every_scheme_has_one_entry_and_a_local_store_is_named_by_digest() -> None:
    assert backend_for("s3://b/p") is backend_for("s3a://b/p") is S3
    assert backend_for("/srv/ckpt") is backend_for("file:///srv/ckpt") is BACKENDS["local"]
    assert backend_for("gcs://b/p") is GENERIC  # only the builtins fsspec raises
    assert "/srv" not in tier_label("local:///srv/ckpt")
    assert tier_label("memory://x/y") == "persistent memory://x/y"
    # every backend's credential-leaking loggers, and fsspec's, are held at INFO
    assert {"botocore", "s3fs", "fsspec"} <= set(QUIET_LOGGERS)
    assert len(QUIET_LOGGERS) == len(set(QUIET_LOGGERS))
