"""`tierckpt pull` goes through the daemon's restore chain (EnsureLocal per file): a file
this node does not hold is restored from a peer or from the persistent tier, a corrupt
local copy is repaired, and a tier that is down is reported as such (not as the daemon
being down). Real daemons, a real peer listener, moto S3 over HTTP; every pulled file is
compared byte for byte with the copy the save wrote, and loaded with stock DCP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import moto_s3
from tests.support.backends import Directory, Tiered
from tests.support.cli import cli, cli_json
from tests.support.cluster import LocalCluster, local_cluster
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "pullns"
CKPT = "step-000007"
NBYTES = 3 << 20


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _save(c: LocalCluster, seed: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Node 0's rank saves CKPT; (the state's snapshot, the files node 0 wrote)."""
    state = plain_tensor_state(seed, NBYTES)
    Tiered(NS, c.nodes[0].address).save(state, CKPT)
    written = _files(c.nodes[0].data_dir(NS, CKPT))
    assert ".metadata" in written and len(written) >= 2, written.keys()
    return snapshot(state), written


def _pull(address: str, dest: Path) -> dict[str, Any]:
    row = cli_json(address, "pull", NS, CKPT, str(dest))
    assert isinstance(row, dict), row
    return row


def _assert_pulled(dest: Path, written: dict[str, bytes], expected: dict[str, Any]) -> None:
    pulled = _files(dest)
    assert pulled.keys() == written.keys()
    for name, data in written.items():
        assert pulled[name] == data, f"{name} differs after pull"
    target = plain_tensor_state(99, NBYTES)  # differs from every saved value
    Directory(str(dest.parent)).load(target, dest.name)
    assert_state_equal(actual=target, expected=expected, what=f"stock load of {dest}")


def _tiers(c: LocalCluster, i: int) -> list[str]:
    return list(c.rows(i)[CKPT]["tiers"])


def test_pull_restores_files_only_a_peer_holds_and_repairs_a_corrupt_copy(
    tmp_path: Path,
) -> None:
    with local_cluster(2, namespace=NS, copies=1, heal_interval=3600.0) as c:
        expected, written = _save(c, 7)
        c.wait_state(CKPT, "REPLICATED")
        # Node 0 dies with its RAM; its empty replacement learns the checkpoint from node 1.
        c.lose(0)
        c.replace(0)
        # It came back empty and learnt the checkpoint from node 1, which pushes node 0's
        # files back at once: the pull fetches whatever has not landed yet.
        assert "adopted 1 checkpoints from peers' manifests" in c.nodes[0].log_tail(200)

        row = _pull(c.nodes[0].address, tmp_path / "a" / CKPT)
        assert row["files"] == len(written) and row["bytes"] == sum(map(len, written.values()))
        _assert_pulled(tmp_path / "a" / CKPT, written, expected)
        # the restored copies landed in node 0's memory tier, verified
        assert _files(c.nodes[0].data_dir(NS, CKPT)) == written
        assert "memory" in _tiers(c, 0)

        # A byte of node 0's copy flips: the next pull has it repaired from node 1.
        victim = max(written, key=lambda n: len(written[n]))
        path = c.nodes[0].data_dir(NS, CKPT) / victim
        with open(path, "r+b") as f:
            f.seek(len(written[victim]) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        proc = cli(c.nodes[0].address, "pull", NS, CKPT, str(tmp_path / "b" / CKPT))
        assert "Traceback" not in proc.stderr, proc.stderr
        _assert_pulled(tmp_path / "b" / CKPT, written, expected)
        assert (c.nodes[0].data_dir(NS, CKPT) / victim).read_bytes() == written[victim]


def test_pull_restores_files_only_the_persistent_tier_holds(
    s3: moto_s3.S3Bucket, moto_server: moto_s3.MotoServer, tmp_path: Path
) -> None:
    persistent = {
        "persistent": {
            "url": s3.url(),
            "storage_options": dict(s3.storage_options),
            "compression": "zstd",
        }
    }
    with local_cluster(1, namespace=NS, overrides=persistent) as c:
        expected, written = _save(c, 8)
        c.wait_state(CKPT, "DURABLE")
        # The node restarts with an empty memory tier: only S3 still has the checkpoint.
        c.lose(0)
        c.replace(0)
        assert _tiers(c, 0) == ["persistent"], c.rows(0)
        assert not c.nodes[0].data_dir(NS, CKPT).exists()

        # S3 down: the pull fails naming the tier, and not as "the daemon is down".
        moto_server.stop()
        try:
            down = cli(c.nodes[0].address, "pull", NS, CKPT, str(tmp_path / "x"), check=False)
        finally:
            moto_server.restart()
        assert down.returncode == 1, down
        assert "tier unavailable" in down.stderr, down.stderr
        assert "persistent" in down.stderr or "s3://" in down.stderr, down.stderr
        assert "not reachable" not in down.stderr and "Traceback" not in down.stderr

        row = _pull(c.nodes[0].address, tmp_path / "a" / CKPT)
        assert row["files"] == len(written)
        _assert_pulled(tmp_path / "a" / CKPT, written, expected)
        assert _files(c.nodes[0].data_dir(NS, CKPT)) == written
