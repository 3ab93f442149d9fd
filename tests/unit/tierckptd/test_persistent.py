"""PersistentTier against a real S3 endpoint (moto over HTTP) and a local file:// root.

Every drained checkpoint is loaded back with stock DCP only (`dcp.load` with an
``s3://`` checkpoint_id, endpoint and credentials from the environment).
"""

from __future__ import annotations

import json
import logging
import pickle
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
import zstandard
from tierckpt.errors import CheckpointIncomplete, ChecksumMismatch, InvalidName
from tierckptd.config import PersistentConfig
from tierckptd.persistent.errors import S3, Failure
from tierckptd.persistent.format import ZSTD_DESCRIPTOR, BytesSource, data_files
from tierckptd.persistent.retry import Op, retry_call
from tierckptd.persistent.store import (
    FileUpload,
    PersistentTier,
    PersistentTierUnavailable,
    RetryPolicy,
)

from tests.support import moto_s3
from tests.support.dcp_files import (
    SavedCheckpoint,
    assert_state_equal,
    load_target,
    save_checkpoint,
    save_two_rank_checkpoint,
)

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "run7"
FAST = RetryPolicy(max_attempts=3, deadline=None, base=0.01, cap=0.02)


def make_tier(bucket: moto_s3.S3Bucket, compression: str = "zstd", **kw: Any) -> PersistentTier:
    kw.setdefault("retry", FAST)
    return PersistentTier(
        bucket.url("ckpts"), bucket.storage_options, compression=compression, level=3, **kw
    )


def drain(tier: PersistentTier, saved: SavedCheckpoint, ckpt: str) -> None:
    """What the drain will do: data files (verified, maybe compressed), then .metadata."""
    files = data_files(saved.metadata)
    uploads = [
        FileUpload(
            name,
            saved.verified(name),
            len(saved.data(name)),
            items=files[name].items,
            fingerprint=saved.checksums(name).summary(),
        )
        for name in saved.data_names
    ]
    tier.upload_files(NS, ckpt, uploads)
    assert not tier.is_durable(NS, ckpt)
    tier.upload_metadata_last(NS, ckpt, saved.metadata)


def stock_load(url: str, saved: SavedCheckpoint) -> None:
    target = load_target(saved.state)
    with pytest.raises(AssertionError):
        assert_state_equal(actual=target, expected=saved.state)
    dcp.load(target, checkpoint_id=url)  # stock FsspecReader, endpoint from the env
    assert_state_equal(actual=target, expected=saved.state)


@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("two_rank", [False, True])
def test_drain_loads_with_stock_dcp(
    s3: moto_s3.S3Bucket, tmp_path: Path, compression: str, two_rank: bool
) -> None:
    if two_rank:
        saved = save_two_rank_checkpoint(tmp_path / "hot")
    else:
        saved = save_checkpoint(tmp_path / "hot")
    tier = make_tier(s3, compression)
    drain(tier, saved, "step-000100")

    fs = s3.fs()
    prefix = f"{s3.name}/ckpts/{NS}/step-000100"
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(prefix)) == [".metadata", *saved.data_names]
    stored = pickle.loads(fs.cat_file(f"{prefix}/.metadata"))
    for info in stored.storage_data.values():
        if compression == "zstd":
            assert info.transform_descriptors == [ZSTD_DESCRIPTOR]
        else:
            assert not getattr(info, "transform_descriptors", None)
    if compression == "none":
        assert fs.cat_file(f"{prefix}/.metadata") == saved.metadata
        for name in saved.data_names:
            assert fs.cat_file(f"{prefix}/{name}") == saved.data(name)

    assert tier.checkpoint_url(NS, "step-000100") == s3.url("ckpts", NS, "step-000100")
    stock_load(s3.url("ckpts", NS, "step-000100"), saved)


def test_metadata_is_the_commit_marker(s3: moto_s3.S3Bucket, tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot", thread_count=2)
    tier = make_tier(s3)
    first, second = saved.data_names
    tier.upload_file(NS, "step-000001", first, saved.data(first), items=None)
    assert not tier.is_durable(NS, "step-000001")
    assert tier.list_durable(NS) == []
    with pytest.raises(CheckpointIncomplete, match=second):
        tier.upload_metadata_last(NS, "step-000001", saved.metadata)
    assert not s3.fs().exists(s3.url("ckpts", NS, "step-000001", ".metadata"))

    items = data_files(saved.metadata)[second].items
    tier.upload_file(NS, "step-000001", second, saved.verified(second), items=items)
    assert set(tier.uploaded(NS, "step-000001")) == {first, second}
    tier.upload_metadata_last(NS, "step-000001", saved.metadata)
    assert tier.is_durable(NS, "step-000001")
    # first went up verbatim, second compressed: the .metadata says so per file
    stored = pickle.loads(tier.fs.cat_file(f"{tier.checkpoint_path(NS, 'step-000001')}/.metadata"))
    descriptors = {i.relative_path: i.transform_descriptors for i in stored.storage_data.values()}
    assert descriptors == {first: None, second: [ZSTD_DESCRIPTOR]}
    stock_load(tier.checkpoint_url(NS, "step-000001"), saved)

    # bookkeeping lives outside the checkpoint directory
    assert s3.fs().exists(f"{s3.name}/ckpts/.tierckpt/{NS}/step-000001/files/{first}.json")


def test_list_and_delete(s3: moto_s3.S3Bucket, tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    tier = make_tier(s3)
    for ckpt in ("step-000020", "step-000100", "step-000003"):
        drain(tier, saved, ckpt)
    tier.upload_file(NS, "step-000200", saved.data_names[0], saved.data(saved.data_names[0]))
    assert tier.list_durable(NS) == ["step-000003", "step-000020", "step-000100"]
    assert tier.list_durable("other") == []

    removed: list[str] = []
    rm = tier.fs.rm

    def spy(path: str, *args: Any, **kwargs: Any) -> Any:
        removed.append(path)
        return rm(path, *args, **kwargs)

    tier.fs.rm = spy
    tier.delete(NS, "step-000020")
    assert removed[0].endswith("step-000020/.metadata")
    assert tier.list_durable(NS) == ["step-000003", "step-000100"]
    fs = s3.fs()
    fs.invalidate_cache()
    assert not fs.exists(f"{s3.name}/ckpts/{NS}/step-000020/__0_0.distcp")
    assert not fs.exists(f"{s3.name}/ckpts/.tierckpt/{NS}/step-000020")
    tier.delete(NS, "step-000020")  # idempotent
    tier.delete(NS, "never-saved")


def test_read_range(s3: moto_s3.S3Bucket, tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    name = saved.data_names[0]
    raw = saved.data(name)
    plain, packed = make_tier(s3, "none"), make_tier(s3, "zstd")
    drain(plain, saved, "plain")
    drain(packed, saved, "packed")
    assert plain.read_range(NS, "plain", name, 1000, 5000) == raw[1000:6000]
    assert plain.read_range(NS, "plain", name, 0, 0) == b""
    with pytest.raises(EOFError):
        plain.read_range(NS, "plain", name, len(raw) - 10, 20)
    index = packed.uploaded(NS, "packed")[name].index
    assert index is not None
    for offset, length in data_files(saved.metadata)[name].items:
        new_offset, new_length = index[offset]
        frame = packed.read_range(NS, "packed", name, new_offset, new_length)
        assert zstandard.ZstdDecompressor().decompress(frame) == raw[offset : offset + length]
    with pytest.raises(FileNotFoundError):
        plain.read_range(NS, "missing", name, 0, 10)


class StopsServer:
    """A source that takes the S3 endpoint down after its first chunk has been read."""

    def __init__(self, data: bytes, server: moto_s3.MotoServer) -> None:
        self._inner = BytesSource(data)
        self._server = server
        self.reads = 0

    @property
    def size(self) -> int:
        return self._inner.size

    def read(self, start: int, length: int) -> memoryview:
        self.reads += 1
        if self.reads == 2:
            self._server.stop()
        return memoryview(self._inner.read(start, length))


def test_outage_mid_upload_then_resume(
    s3: moto_s3.S3Bucket,
    moto_server: moto_s3.MotoServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    name = saved.data_names[0]
    big = bytes(range(256)) * (11 << 12)  # 11 MiB: a multipart upload of 5 MiB parts
    tier = make_tier(s3, "none", block_size=5 << 20)
    source = StopsServer(big, moto_server)
    with caplog.at_level(logging.WARNING, logger="tierckptd.persistent.store"):
        with pytest.raises(PersistentTierUnavailable, match="retry later"):
            tier.upload_file(NS, "step-000001", "__1_0.distcp", source, len(big))
        with pytest.raises(PersistentTierUnavailable):
            tier.is_durable(NS, "step-000001")  # an outage is not "not durable"
    retries = [r for r in caplog.records if "attempt" in r.getMessage()]
    assert len(retries) >= 2 and "attempt 1 of 3" in retries[0].getMessage()

    moto_server.restart()
    assert not tier.is_durable(NS, "step-000001")
    assert tier.uploaded(NS, "step-000001") == {}
    tier.upload_file(NS, "step-000001", "__1_0.distcp", big, len(big))
    tier.upload_file(NS, "step-000001", "__1_0.distcp", big, len(big))  # idempotent
    assert (
        tier.read_range(NS, "step-000001", "__1_0.distcp", (5 << 20) - 3, 10)
        == big[(5 << 20) - 3 : (5 << 20) + 7]
    )
    drain(tier, saved, "step-000001")
    assert tier.is_durable(NS, "step-000001")
    assert name in tier.uploaded(NS, "step-000001")


def test_permanent_errors_are_not_retried(s3: moto_s3.S3Bucket, tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    name = saved.data_names[0]
    sleeps: list[float] = []
    missing = PersistentTier(
        s3.url().replace(s3.name, "no-such-bucket"),
        s3.storage_options,
        retry=FAST,
        sleep=sleeps.append,
    )
    with pytest.raises(FileNotFoundError):
        missing.upload_file(NS, "step-000001", name, saved.data(name))
    verified = saved.verified(name)
    (saved.directory / name).write_bytes(b"\0" * len(saved.data(name)))
    tier = make_tier(s3, sleep=sleeps.append)
    with verified, pytest.raises(ChecksumMismatch):
        tier.upload_file(
            NS, "step-000001", name, verified, items=data_files(saved.metadata)[name].items
        )
    assert sleeps == []
    with pytest.raises(InvalidName):
        tier.upload_file(NS, "step-000001", ".metadata", b"x")
    with pytest.raises(InvalidName):
        tier.upload_file(".tierckpt", "step-000001", name, b"x")
    with pytest.raises(ValueError, match="expected 3"):
        tier.upload_file(NS, "step-000001", name, b"xx", 3)


def test_local_url_and_from_config(tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    config = PersistentConfig(url=f"file://{tmp_path / 'store'}", compression="zstd", level=5)
    tier = PersistentTier.from_config(config, retry=FAST)
    drain(tier, saved, "step-000007")
    ckpt_dir = tmp_path / "store" / NS / "step-000007"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [".metadata", *saved.data_names]
    assert tier.list_durable(NS) == ["step-000007"]
    target = load_target(saved.state)
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(ckpt_dir)))
    assert_state_equal(actual=target, expected=saved.state)
    tier.delete(NS, "step-000007")
    assert not ckpt_dir.exists() and tier.list_durable(NS) == []


def test_retry_policy() -> None:
    clock = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock[0] += s

    calls = [0]

    def flaky() -> str:
        calls[0] += 1
        if calls[0] < 3:
            raise ConnectionError("reset by peer")
        return "ok"

    policy = RetryPolicy(max_attempts=5, deadline=None, base=1.0, cap=3.0)
    assert (
        retry_call(flaky, "op", policy, op=Op.READ, backend=S3, sleep=sleep, clock=lambda: clock[0])
        == "ok"
    )
    assert len(sleeps) == 2 and 0.5 <= sleeps[0] <= 1.0 and 1.0 <= sleeps[1] <= 2.0
    assert [policy.backoff(n, lambda: 1.0) for n in (1, 2, 3, 4, 10)] == [1, 2, 3, 3, 3]

    def down() -> None:
        raise OSError("503 SlowDown")

    sleeps.clear()
    with pytest.raises(PersistentTierUnavailable) as caught:
        retry_call(down, "op", policy, op=Op.READ, backend=S3, sleep=sleep, clock=lambda: clock[0])
    assert len(sleeps) == 4 and isinstance(caught.value.__cause__, OSError)

    sleeps.clear()
    by_deadline = RetryPolicy(max_attempts=0, deadline=5.0, base=1.0, cap=1.0)
    with pytest.raises(PersistentTierUnavailable):
        retry_call(
            down, "op", by_deadline, op=Op.READ, backend=S3, sleep=sleep, clock=lambda: clock[0]
        )
    assert 4 <= len(sleeps) <= 9 and sum(sleeps) <= 5.0

    with pytest.raises(ValueError, match="never gives up"):
        RetryPolicy(max_attempts=0, deadline=None)


def test_the_s3_table_says_what_a_failure_means() -> None:
    class EndpointConnectionError(Exception):  # botocore's, by name
        pass

    class ClientError(Exception):  # botocore's, untranslated: only its code says what
        def __init__(self, code: str) -> None:
            super().__init__(code)
            self.response = {"Error": {"Code": code}}

    assert S3.is_transient(ConnectionRefusedError())
    assert S3.is_transient(TimeoutError())
    assert S3.is_transient(OSError(16, "SlowDown"))
    assert S3.is_transient(EndpointConnectionError())
    assert S3.is_transient(ClientError("SlowDown"))
    assert S3.classify(PermissionError("AccessDenied")) is Failure.DENIED
    assert S3.classify(ClientError("ExpiredToken")) is Failure.DENIED
    assert S3.classify(FileNotFoundError("NoSuchBucket")) is Failure.MISSING
    assert S3.classify(ClientError("NoSuchKey")) is Failure.MISSING
    assert S3.classify(ClientError("SomethingNew")) is Failure.UNAVAILABLE
    assert S3.classify(PersistentTierUnavailable("down")) is Failure.UNAVAILABLE
    assert S3.classify(ChecksumMismatch("bad block")) is None  # damage, not an outage
    assert S3.classify(ValueError()) is None
    assert S3.classify(FileExistsError()) is None
    copy = pickle.loads(pickle.dumps(PersistentTierUnavailable("ns/step-1: down")))
    assert type(copy) is PersistentTierUnavailable and str(copy) == "ns/step-1: down"


# ---- an untrusted bucket and the shutdown deadline ----------------------------------------


def test_listing_skips_keys_that_are_not_names(s3: moto_s3.S3Bucket, tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    tier = make_tier(s3, "none")
    drain(tier, saved, "step-000001")
    fs = s3.fs()
    for key in (f"{NS}/bad 0/.metadata", f"{NS}/..x/y/.metadata", "bad ns/step-1/.metadata"):
        fs.pipe_file(f"{s3.name}/ckpts/{key}", b"x")
    assert tier.list_namespaces() == [NS]
    assert tier.list_durable(NS) == ["step-000001"]


def _marker_path(tier: PersistentTier, ckpt: str, name: str) -> str:
    return f"{tier.root}/.tierckpt/{NS}/{ckpt}/files/{name}.json"


_BAD_MARKERS: list[dict[str, Any]] = [
    {"size": -1},
    {"source_size": 1e308},
    {"size": "12"},
    {"size": True},
    {"index": [[0, -5, 10]]},
    {"index": [[0, 0]]},
    {"index": "x"},
    {"name": "../x"},
    {"name": "__9_0.distcp"},  # describes another file than the one it is stored as
    {"compression": "gzip"},
]


def test_a_bad_marker_counts_as_not_uploaded(s3: moto_s3.S3Bucket, tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path / "hot")
    name = saved.data_names[0]
    tier = make_tier(s3)
    items = data_files(saved.metadata)[name].items
    tier.upload_file(NS, "step-000001", name, saved.data(name), items=items)
    path = _marker_path(tier, "step-000001", name)
    good = json.loads(tier.fs.cat_file(path))
    for change in _BAD_MARKERS:
        tier.fs.pipe_file(path, json.dumps({**good, **change}).encode())
        assert tier.uploaded(NS, "step-000001") == {}, change
        with pytest.raises(CheckpointIncomplete):
            tier.upload_metadata_last(NS, "step-000001", saved.metadata)
    tier.fs.pipe_file(path, json.dumps(good).encode())
    assert set(tier.uploaded(NS, "step-000001")) == {name}
    # Bookkeeping objects are read with a bound, never whole if a tampered one is huge.
    tier.put_bookkeeping(NS, "step-000001", "manifest.json", b"m" * 100)
    assert tier.read_bookkeeping(NS, "step-000001", "manifest.json") == b"m" * 100
    assert tier.read_bookkeeping(NS, "step-000001", "manifest.json", max_bytes=100) == b"m" * 100
    with pytest.raises(ValueError, match="larger than 99 bytes"):
        tier.read_bookkeeping(NS, "step-000001", "manifest.json", max_bytes=99)
    assert tier.read_bookkeeping(NS, "step-000001", "missing.json") is None


def test_retry_call_honours_a_deadline_set_meanwhile() -> None:
    clock = [0.0]
    until: list[float | None] = [None]

    def sleep(s: float) -> None:
        clock[0] += s
        until[0] = 3.0  # shutdown begins while we back off

    def down() -> None:
        raise OSError("503 SlowDown")

    policy = RetryPolicy(max_attempts=0, deadline=300.0, base=1.0, cap=1.0)
    with pytest.raises(PersistentTierUnavailable):
        retry_call(
            down,
            "op",
            policy,
            op=Op.READ,
            backend=S3,
            sleep=sleep,
            clock=lambda: clock[0],
            until=lambda: until[0],
        )
    assert clock[0] <= 3.0
    clock[0] = 5.0
    with pytest.raises(PersistentTierUnavailable, match="not attempted"):
        retry_call(
            lambda: "ok",
            "op",
            policy,
            op=Op.READ,
            backend=S3,
            clock=lambda: clock[0],
            until=lambda: until[0],
        )


def test_a_deadline_abandons_a_call_that_hangs() -> None:
    """An endpoint that accepts and never answers: botocore would wait its read timeout
    (60 s) per try; set_deadline bounds the call, and a later one fails at once."""
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(16)
        port = blackhole.getsockname()[1]
        tier = PersistentTier(
            f"s3://bucket-{port}/x",
            {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"},
        )
        tier.set_deadline(1.0)
        started = time.monotonic()
        with pytest.raises(PersistentTierUnavailable, match="deadline"):
            tier.is_durable(NS, "step-000001")
        assert time.monotonic() - started < 1.6
        with pytest.raises(PersistentTierUnavailable, match="deadline"):
            tier.list_namespaces()
        assert time.monotonic() - started < 1.8
