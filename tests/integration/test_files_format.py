"""A format-neutral ("files") checkpoint through real daemons and a moto S3 server.

One two-node cluster (two copies) and one save serve every step: the files are held,
replicated, drained to S3 in the plain layout a local filesystem would have (its commit
marker in the bookkeeping, last), served from the buddy when the writer's node is lost,
and restored byte for byte from S3 when the whole cluster is. The save carries a file
named `.metadata` holding a pickle that would run a command if anything unpickled it,
and bytes DCP's allow-list refuses: in a "files" checkpoint it is data, stored and
served, never decoded (a decoded one would be refused, and never become DURABLE).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tierckpt.daemon_client import DaemonClient

from tests.support import moto_s3
from tests.support.cluster import local_cluster
from tests.support.raw_rpc import write_files
from tests.support.s3_drain import persistent

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "files-run"


def _files(tmp_path: Path) -> dict[str, bytes]:
    pwned = tmp_path / "pwned"
    hostile = f"cos\nsystem\n(S'touch {pwned}'\ntR.".encode()
    return {
        ".metadata": hostile,
        "metadata.pkl": b"\x80\x04K\x01.",
        "model_0.pt": os.urandom(300_000),
        "optim_0.pt": os.urandom(70_001),
    }


def _read(client: DaemonClient, checkpoint_id: str, name: str) -> bytes:
    entry = client.ensure_local(NS, checkpoint_id, name)
    return Path(entry.local_path).read_bytes()


@pytest.mark.timeout(240)
def test_a_files_checkpoint_is_held_replicated_drained_and_restored_byte_for_byte(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    files = _files(tmp_path)
    with local_cluster(2, namespace=NS, copies=2, overrides=persistent(s3)) as c:
        client = DaemonClient(c.nodes[0].address, timeout_s=60)
        try:
            write_files(client, NS, "step-1", files)
            info = client.commit_checkpoint(
                NS, "step-1", list(files), durable=True, checkpoint_format="files"
            )
        finally:
            client.close()
        assert info.checkpoint_format == "files"
        c.wait_state("step-1", "DURABLE", timeout=90.0)
        # S3: exactly the files, verbatim (no compression, no rewrite), at the plain path;
        # the commit marker lists them, in the bookkeeping.
        fs = s3.fs()
        fs.invalidate_cache()
        base = f"{s3.name}/{NS}/step-1"
        assert {p[len(base) + 1 :] for p in fs.find(base)} == set(files)
        for name, data in files.items():
            assert fs.cat_file(f"{base}/{name}") == data
        marker = json.loads(fs.cat_file(f"{s3.name}/.tierckpt/{NS}/step-1/files-commit.json"))
        assert {f["name"]: f["size"] for f in marker["files"]} == {
            n: len(d) for n, d in files.items()
        }
        # Node 0 lost with its memory: node 1 serves its replica.
        c.lose(0)
        buddy = DaemonClient(c.nodes[1].address, timeout_s=60)
        try:
            for name, data in files.items():
                assert _read(buddy, "step-1", name) == data
        finally:
            buddy.close()
        # The whole cluster lost: the restarted nodes adopt it from S3 and restore it.
        c.lose(1)
        c.replace(0, 1)
        fresh = DaemonClient(c.nodes[1].address, timeout_s=60)
        try:
            c.wait("node 1 to adopt step-1 from S3", lambda: "step-1" in c.rows(1), 60.0)
            row = c.rows(1)["step-1"]
            assert (row["state"], row["tiers"], row["format"]) == (
                "DURABLE",
                ["persistent"],
                "files",
            )
            for name, data in files.items():
                assert _read(fresh, "step-1", name) == data
        finally:
            fresh.close()
    assert not (tmp_path / "pwned").exists()  # nothing unpickled the hostile .metadata
