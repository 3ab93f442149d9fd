"""Audit 3 M7 and L2: a shared bucket with junk in it, and an upload a kill -9 left open.

M7: a few hundred ``<id>/.metadata`` keys (valid names, no bookkeeping) under a namespace
this node drains to, and under one that has no index. Before the fix every start
scanned every namespace before READY, wrote an index entry into the bucket for each
junk key and logged a line for each, and persistent retention counted junk among the
newest checkpoints (and deleted it). Now the start-up adoption runs after READY, from
the index (a namespace without one is scanned, and only ids whose manifest parses get
an entry): no entry is ever written for junk, junk is summarized in the log, and
retention neither counts nor deletes what has no tierckpt bookkeeping.

L2: a multipart upload of a data file this node owns, left open (as a kill -9 mid-drain
leaves it), is aborted when the daemon starts; another key's open upload is left alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tierckpt.daemon_client import DaemonClient

from tests.support import moto_s3
from tests.support.daemon_process import DaemonProcess
from tests.support.dcp_files import save_checkpoint
from tests.support.raw_rpc import raw_save

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

JUNK_INDEXED = 200  # under a namespace with a durable index
JUNK_BARE = 100  # under a namespace without one
DONE = "persistent tier start-up work done"


def _wait(what: str, check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _open_uploads(fs: Any) -> set[str]:
    out = fs.call_s3("list_multipart_uploads", Bucket=moto_s3.BUCKET)
    return {u["Key"] for u in out.get("Uploads") or []}


def _open_upload(fs: Any, key: str) -> None:
    upload = fs.call_s3("create_multipart_upload", Bucket=moto_s3.BUCKET, Key=key)
    fs.call_s3(
        "upload_part",
        Bucket=moto_s3.BUCKET,
        Key=key,
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=b"\0" * 4096,
    )


def _index(fs: Any, namespace: str) -> set[str]:
    path = f"{moto_s3.BUCKET}/jobs/{namespace}/.tierckpt/durable"
    fs.invalidate_cache()
    if not fs.exists(path):
        return set()
    return {p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}


def _starts_done(daemon: DaemonProcess) -> int:
    return daemon.log_path.read_text(errors="replace").count(DONE)


def test_junk_keys_get_no_index_entry_and_a_killed_upload_is_aborted(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    persistent = {"url": s3.url("jobs"), "storage_options": s3.storage_options}
    fs = s3.fs()
    # The shared bucket holds junk before this cluster's first save: under a namespace
    # this node drains to (so, soon, beside an index) and under one without an index.
    junk = {f"{s3.name}/jobs/job/junk-{i}/.metadata": b"junk" for i in range(JUNK_INDEXED)}
    junk |= {f"{s3.name}/jobs/bare/junk-{i}/.metadata": b"junk" for i in range(JUNK_BARE)}
    fs.pipe(junk)
    # keep_last = 1: junk counted as durable checkpoints would be "newer" than step-1
    # (ids without a step sort last) and retention would delete them from the bucket.
    daemon = DaemonProcess(
        {"persistent": {**persistent, "every": 1}, "retention": {"persistent_keep_last": 1}},
        name="hostile",
    )
    fresh: DaemonProcess | None = None
    try:
        client = DaemonClient(daemon.address, timeout_s=30)
        saved = save_checkpoint(tmp_path / "step-1")
        names = [*saved.data_names, ".metadata"]
        raw_save(client, "job", "step-1", {n: (saved.directory / n).read_bytes() for n in names})
        _wait("step-1 durable", lambda: _index(fs, "job") == {"step-1"})
        _wait("step-1 DURABLE", lambda: "persistent" in client.get_checkpoint("job").tiers)
        client.close()

        # A kill -9 mid-drain leaves an upload of our file open; another key's is not ours.
        ours = f"jobs/job/step-1/{saved.data_names[0]}"
        theirs = "jobs/job/step-9/__0_0.distcp"  # not a file this node owns
        _open_upload(fs, ours)
        _open_upload(fs, theirs)
        assert _open_uploads(fs) == {ours, theirs}
        daemon.kill9()
        daemon.start()

        _wait("the stale upload aborted", lambda: ours not in _open_uploads(fs))
        _wait("the start-up work", lambda: _starts_done(daemon) >= 1)
        assert _open_uploads(fs) == {theirs}

        # A replacement node (empty memory tier) adopts from the same bucket.
        fresh = DaemonProcess({"persistent": persistent}, name="fresh")
        _wait("the replacement's start-up work", lambda: _starts_done(fresh) >= 1)
        fresh_client = DaemonClient(fresh.address, timeout_s=30)
        try:
            listed = fresh_client.list_checkpoints("job")
            assert [c.checkpoint_id for c in listed] == ["step-1"]
            assert fresh_client.list_checkpoints("bare") == []
        finally:
            fresh_client.close()

        # No junk was ever indexed, by either daemon; junk is summarized, not logged
        # line by line.
        assert _index(fs, "job") == {"step-1"}
        assert _index(fs, "bare") == set()
        fs.invalidate_cache()
        assert len(fs.glob(f"{s3.name}/jobs/*/junk-*/.metadata")) == JUNK_INDEXED + JUNK_BARE
        for node in (daemon, fresh):
            lines = node.log_path.read_text(errors="replace").splitlines()
            junk_lines = [line for line in lines if "junk-" in line]
            assert len(junk_lines) <= 6, "\n".join(junk_lines[:10])
        assert daemon.running and fresh.running
    finally:
        daemon.cleanup()
        if fresh is not None:
            fresh.cleanup()
