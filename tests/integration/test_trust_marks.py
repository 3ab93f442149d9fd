"""Checkpoints a job can trust, on two real daemons peering on loopback (copies = 1): a
checkpoint marked bad on one node is listed bad on the other and never restored as the
newest there (the newest load skips it, bit-exact from the one before); the newest one
marked verified is what `newest="verified"` loads and what memory retention keeps while
newer ones come and go; marks survive a daemon restart; the CLI refuses a state that is
none; with moto S3 over HTTP, a fresh cluster that lost every node still knows which
checkpoints were bad and verified (the mark is stored beside the checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import torch.distributed.checkpoint as dcp
from tierckpt import TieredStorageReader, Trust
from tierckpt.daemon_client import DaemonClient
from tierckpt.fsspec_fs import TierckptFileSystem

from tests.support import moto_s3
from tests.support.cli import cli, cli_json
from tests.support.cluster import LocalCluster, local_cluster
from tests.support.dcp_files import (
    SavedCheckpoint,
    assert_state_equal,
    load_target,
    make_state,
    save_checkpoint,
)

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "trust-run"
WAIT = 60.0


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict[int, SavedCheckpoint]:
    root = tmp_path_factory.mktemp("trust")
    return {s: save_checkpoint(root / f"s{s}", make_state(seed=s)) for s in (1, 2, 3)}


def _load_newest(
    address: str, newest: Literal["committed", "verified"] = "committed"
) -> tuple[str, Any]:
    reader = TieredStorageReader(NS, daemon=address, newest=newest)
    target = load_target(make_state())
    dcp.load(target, checkpoint_id=None, storage_reader=reader)
    return reader.checkpoint_id, target


def _trust(c: LocalCluster, i: int) -> dict[str, Any]:
    return {cid: row["trust"] for cid, row in c.rows(i).items()}


def test_bad_is_skipped_and_the_newest_verified_is_held_on_every_node(
    states: dict[int, SavedCheckpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = {"retention": {"memory_keep_last": 2}, "memory": {"budget": "256MiB"}}
    with local_cluster(2, namespace=NS, copies=1, overrides=overrides) as c:
        c.raw_save(0, "step-1", states[1].files())
        c.raw_save(0, "step-2", states[2].files())
        c.wait_state("step-2", "REPLICATED")

        out = cli(c.nodes[0].address, "mark", NS, "step-2", "bad", "--reason", "loss is NaN")
        assert "marked trust-run/step-2 bad" in out.stdout, out.stdout
        c.wait("node 1 lists step-2 bad", lambda: _trust(c, 1).get("step-2") == "bad", WAIT)
        assert c.rows(1)["step-2"]["trust_reason"] == "loss is NaN"
        # The newest load on node 1 skips it: step-1, bit-exact.
        loaded, state = _load_newest(c.nodes[1].address)
        assert loaded == "step-1"
        assert_state_equal(actual=state, expected=states[1].state)
        # Named, the bad one still loads (to look at it).
        client = DaemonClient(c.nodes[1].address)
        try:
            assert client.get_checkpoint(NS, "step-2").trust is Trust.BAD
            assert client.get_checkpoint(NS).checkpoint_id == "step-1"
        finally:
            client.close()
        fs = TierckptFileSystem(daemon=c.nodes[1].address)
        assert fs.info(f"tierckpt://{NS}/latest")["checkpoint_id"] == "step-1"
        pulled = cli_json(c.nodes[1].address, "pull", NS, "latest", str(tmp_path / "pulled"))
        assert pulled["id"] == "step-1"
        none = cli(
            c.nodes[1].address, "pull", NS, "latest-verified", str(tmp_path / "v"), check=False
        )
        assert none.returncode == 1 and "marked verified" in none.stderr, none

        # Verified, then three newer saves with memory_keep_last = 2: step-1 stays held.
        marked = cli_json(c.nodes[0].address, "mark", NS, "step-1", "verified")
        assert marked["trust"] == "verified"
        for step in (3, 4, 5):
            c.raw_save(0, f"step-{step}", states[3].files())
        c.wait_state("step-5", "REPLICATED")
        c.wait(
            "the window evicted step-2 and step-3 on both nodes",
            lambda: all(set(c.rows(i)) == {"step-1", "step-4", "step-5"} for i in range(2)),
            WAIT,
        )
        assert c.nodes[0].data_dir(NS, "step-1").exists()
        loaded, state = _load_newest(c.nodes[1].address, newest="verified")
        assert loaded == "step-1"
        assert_state_equal(actual=state, expected=states[1].state)
        assert _load_newest(c.nodes[1].address)[0] == "step-5"
        # The zero-code route: DCP through `tierckpt://NS/latest-verified`.
        monkeypatch.setenv("TIERCKPT_DAEMON", c.nodes[1].address)
        target = load_target(make_state())
        dcp.load(target, checkpoint_id=f"tierckpt://{NS}/latest-verified")
        assert_state_equal(actual=target, expected=states[1].state)
        assert fs.info(f"tierckpt://{NS}/latest")["checkpoint_id"] == "step-5"
        listing = cli(c.nodes[1].address, "ls", NS).stdout
        assert "TRUST" in listing and "verified" in listing, listing

        # A state that is none: a clear message and a non-zero exit, nothing marked.
        wrong = cli(c.nodes[0].address, "mark", NS, "step-4", "good", check=False)
        assert wrong.returncode != 0
        assert "expected one of verified, bad" in wrong.stderr, wrong.stderr
        assert _trust(c, 0)["step-4"] is None

        metrics = c.metrics()
        assert 'tierckpt_trust_marks_total{trust="bad"} 1.0' in metrics
        assert 'tierckpt_trust_marks_total{trust="verified"} 1.0' in metrics

        # Marks survive a restart of either daemon (the marks journal).
        for node in c.nodes:
            node.terminate()
            node.start()
        for i in range(2):
            assert _trust(c, i) == {"step-1": "verified", "step-4": None, "step-5": None}
        c.raw_save(0, "step-6", states[3].files())
        c.wait_state("step-6", "REPLICATED")
        c.wait(
            "step-1 still held after the restart",
            lambda: all(set(c.rows(i)) == {"step-1", "step-5", "step-6"} for i in range(2)),
            WAIT,
        )


def _trust_objects(bucket: moto_s3.S3Bucket) -> dict[str, bytes]:
    fs = bucket.fs()
    fs.invalidate_cache()
    return {p: fs.cat_file(p) for p in fs.find(bucket.name) if p.endswith("/trust.json")}


def test_a_fresh_cluster_knows_the_marks_after_losing_every_node(
    s3: moto_s3.S3Bucket, states: dict[int, SavedCheckpoint]
) -> None:
    overrides = {
        "persistent": {"url": s3.url(), "storage_options": dict(s3.storage_options)},
        "retention": {"memory_keep_last": 0},
        "memory": {"budget": "256MiB"},
    }
    with local_cluster(2, namespace=NS, copies=1, overrides=overrides) as c:
        c.raw_save(0, "step-1", states[1].files())
        # Marked at once: before or while it drains (the drain or the node asked stores it).
        cli(c.nodes[0].address, "mark", NS, "step-1", "verified", "--reason", "eval ok")
        c.raw_save(0, "step-2", states[2].files())
        c.raw_save(0, "step-3", states[3].files())
        for step in (1, 2, 3):
            c.wait_state(f"step-{step}", "DURABLE")
        cli(c.nodes[0].address, "mark", NS, "step-3", "bad")  # durable already
        c.wait(
            "both marks stored in the bucket",
            lambda: len(_trust_objects(s3)) == 2,
            WAIT,
        )
        c.lose(0, 1)  # every node, with its memory tier and its marks journal
        c.replace(0, 1)
        c.wait(
            "the fresh nodes adopted the marks from the bucket",
            lambda: all(
                _trust(c, i) == {"step-1": "verified", "step-2": None, "step-3": "bad"}
                for i in range(2)
            ),
            WAIT,
        )
        assert c.rows(1)["step-1"]["trust_reason"] == "eval ok"
        loaded, state = _load_newest(c.nodes[1].address)
        assert loaded == "step-2"  # step-3 is bad
        assert_state_equal(actual=state, expected=states[2].state)
        loaded, state = _load_newest(c.nodes[0].address, newest="verified")
        assert loaded == "step-1"
        assert_state_equal(actual=state, expected=states[1].state)
        # An rm deletes the stored mark with the checkpoint: a re-save starts unmarked.
        cli(c.nodes[0].address, "rm", NS, "step-3")
        assert len(_trust_objects(s3)) == 1
