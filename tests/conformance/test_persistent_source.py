"""The FileSource contract against the persistent tier, read through `PersistentSource`:
on ``file://`` and on S3 (moto's server over HTTP), each with the bytes stored verbatim
and as per-item zstd frames (what a drain of a DCP file writes).

Files go in through `PersistentTier.upload_files`, the drain's own upload (markers
included); zstd items are slices of each file, doubling in size. S3 stores live in one
bucket for the module (each test has a namespace of its own). An outage on S3 stops the
moto server (connections refused) and restarts it on the same port with its objects; a
``file://`` root has no service to stop, so its outage turns the root into a path the
OS cannot resolve (ELOOP), as a stale network mount fails with an error other than
"not found".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import s3fs
from tierckptd.catalog import Catalog
from tierckptd.model import FileRecord
from tierckptd.persistent.errors import BACKENDS, backend_for
from tierckptd.persistent.markers import FileUpload, fingerprint
from tierckptd.persistent.source import PersistentSource
from tierckptd.persistent.store import PersistentTier, RetryPolicy
from tierckptd.restore import FileSource

from tests.conformance.file_source_contract import Backend, FileSourceContract, expected_record
from tests.support import moto_s3
from tests.support.moto_s3 import BUCKET, FAST_FAIL_CONFIG, MotoServer

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server

# zstd items (frames) double in size from this: odd sizes that straddle blocks, several
# per file, and few enough that S3 is not asked a thousand times.
FIRST_ITEM = 50_001
FAST_RETRY = RetryPolicy(max_attempts=2, deadline=5.0, base=0.05, cap=0.1)


def items_of(size: int) -> list[tuple[int, int]]:
    items, offset, length = [], 0, FIRST_ITEM
    while offset < size:
        items.append((offset, min(length, size - offset)))
        offset += length
        length *= 2
    return items


class PersistentBackend(Backend):
    """One persistent-tier root, failing fast (two attempts) when it is down."""

    def __init__(self, url: str, compression: str, storage_options: dict[str, Any]) -> None:
        self.compression = compression
        self.tier = PersistentTier(
            url, storage_options, compression=compression, retry=FAST_RETRY, max_concurrency=2
        )

    def store(
        self, namespace: str, checkpoint_id: str, files: Mapping[str, bytes]
    ) -> dict[str, FileRecord]:
        records = {name: expected_record(name, data) for name, data in files.items()}
        zstd = self.compression == "zstd"
        self.tier.upload_files(
            namespace,
            checkpoint_id,
            [
                FileUpload(
                    name=name,
                    source=data,
                    size=len(data),
                    items=items_of(len(data)) if zstd else None,
                    fingerprint=fingerprint(records[name]),
                )
                for name, data in files.items()
            ],
        )
        return records

    def source(self, catalog: Catalog) -> FileSource:
        return PersistentSource(self.tier)

    def _object(self, namespace: str, checkpoint_id: str, name: str) -> str:
        return f"{self.tier.checkpoint_path(namespace, checkpoint_id)}/{name}"

    def corrupt_byte(self, namespace: str, checkpoint_id: str, name: str, offset: int) -> None:
        marker = self.tier.uploaded(namespace, checkpoint_id)[name]
        where = offset
        if marker.index is not None:  # the frame holding that byte: its last byte (checksum)
            old = max(o for o in marker.index if o <= offset)
            start, length = marker.index[old]
            where = start + length - 1
        path = self._object(namespace, checkpoint_id, name)
        data = bytearray(self.tier.fs.cat_file(path))
        data[where] ^= 0xFF
        self.tier.fs.pipe_file(path, bytes(data))
        self.tier.fs.invalidate_cache(path)

    def lose(self, namespace: str, checkpoint_id: str, name: str) -> None:
        path = self._object(namespace, checkpoint_id, name)
        self.tier.fs.rm(path)
        self.tier.fs.invalidate_cache(path)


class FileBackend(PersistentBackend):
    def __init__(self, root: Path, compression: str) -> None:
        root.mkdir()
        self.root = root
        super().__init__(f"file://{root}", compression, {})

    def outage(self) -> None:
        self.root.rename(self.root.with_name(self.root.name + ".down"))
        self.root.symlink_to(self.root.name)  # ELOOP for every path under it

    def restore_service(self) -> None:
        if self.root.is_symlink():
            self.root.unlink()
            self.root.with_name(self.root.name + ".down").rename(self.root)


class S3Backend(PersistentBackend):
    def __init__(self, server: MotoServer, bucket: str, prefix: str, compression: str) -> None:
        self.server = server
        super().__init__(f"s3://{bucket}/{prefix}", compression, s3_options(server))

    def outage(self) -> None:
        self.server.stop()

    def restore_service(self) -> None:
        self.server.restart()


def s3_options(server: MotoServer) -> dict[str, Any]:
    """Fake credentials given explicitly (no environment needed), failing fast."""
    return {
        "endpoint_url": server.endpoint_url,
        "key": "testing",
        "secret": "testing",
        "config_kwargs": dict(FAST_FAIL_CONFIG),
    }


class TestFilePersistentSource(FileSourceContract):
    @pytest.fixture(params=["none", "zstd"])
    def compression(self, request: pytest.FixtureRequest) -> str:
        return str(request.param)

    @pytest.fixture
    def backend(self, tmp_path: Path, compression: str) -> Iterator[FileBackend]:
        b = FileBackend(tmp_path / "persistent-one", compression)
        yield b
        b.restore_service()

    @pytest.fixture
    def other_backend(self, tmp_path: Path, compression: str) -> Iterator[FileBackend]:
        b = FileBackend(tmp_path / "persistent-two", compression)
        yield b
        b.restore_service()


@pytest.fixture(scope="module")
def bucket(moto_server: MotoServer) -> str:
    """One bucket for the module (each test stores under a namespace of its own)."""
    moto_server.restart()
    moto_server.reset()
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem(**s3_options(moto_server)).mkdir(BUCKET)
    return BUCKET


@pytest.fixture(scope="module")
def second_moto_server() -> Iterator[MotoServer]:
    """Another endpoint of the same moto state, so that one store's outage leaves the
    other up."""
    server = MotoServer()
    yield server
    server.stop()


class TestS3PersistentSource(FileSourceContract):
    """S3 as a drain writes it (zstd frames: ranged GETs); file:// covers "none"."""

    @pytest.fixture
    def compression(self) -> str:
        return "zstd"

    @pytest.fixture
    def backend(
        self, bucket: str, moto_server: MotoServer, compression: str
    ) -> Iterator[S3Backend]:
        yield S3Backend(moto_server, bucket, "one", compression)
        moto_server.restart()  # after an outage

    @pytest.fixture
    def other_backend(
        self, bucket: str, second_moto_server: MotoServer, compression: str
    ) -> Iterator[S3Backend]:
        # moto's servers in one process share their state: the bucket is there too,
        # behind an endpoint with outages of its own.
        yield S3Backend(second_moto_server, bucket, "two", compression)
        second_moto_server.restart()


def test_every_backend_in_the_table_has_a_suite_here() -> None:
    """A persistent backend is an entry in `persistent.errors.BACKENDS` plus a subclass
    of the contract here; an entry without one is untested knowledge."""
    suites = {TestFilePersistentSource: "file", TestS3PersistentSource: "s3"}
    tabled = {id(b) for b in BACKENDS.values()}
    assert tabled == {id(backend_for(f"{scheme}://x/y")) for scheme in suites.values()}
