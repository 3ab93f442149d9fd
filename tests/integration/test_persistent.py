"""Persistent tier end to end: real daemons drain to a moto S3 server over HTTP.

Every drained checkpoint is loaded back by STOCK DCP (`dcp.load(sd, checkpoint_id=
"s3://bucket/ns/id")`, endpoint from AWS_ENDPOINT_URL_S3, no tierckpt reader), bit-exact.
"""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from tests.support import jobs, moto_s3
from tests.support.backends import Nodes
from tests.support.cluster import LocalCluster, local_cluster, save_job
from tests.support.dist_job import run_job
from tests.support.s3_drain import s3_names, stock_load

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "drain-run"


def persistent(bucket: moto_s3.S3Bucket, **keys: Any) -> dict[str, Any]:
    return {
        "persistent": {
            "url": bucket.url(),
            "storage_options": dict(bucket.storage_options),
            **keys,
        }
    }


def cluster(n: int, overrides: dict[str, Any]) -> AbstractContextManager[LocalCluster]:
    """`n` daemons peering with each other (n = 1: a single node), all draining to S3."""
    return local_cluster(n, namespace=NS, overrides=overrides)


def _memory_names(c: LocalCluster, checkpoint_id: str) -> set[str]:
    names: set[str] = set()
    for d in c.nodes:
        directory = d.data_dir(NS, checkpoint_id)
        if directory.is_dir():
            names |= {p.name for p in directory.iterdir()}
    return names


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_single_node_drains_and_stock_dcp_loads_from_s3(
    s3: moto_s3.S3Bucket, tmp_path: Path, compression: str
) -> None:
    with cluster(1, persistent(s3, compression=compression)) as c:
        save_job(c, 2, 2, ["step-000001"], tmp_path, 11)
        c.wait_state("step-000001", "DURABLE")
        row = c.rows()["step-000001"]
        assert "persistent" in row["tiers"] and "memory" in row["tiers"]
        # Exactly the DCP files, nothing else, in the checkpoint's directory.
        assert s3_names(s3, NS, "step-000001") == _memory_names(c, "step-000001")
        stock_load(s3, NS, 2, "step-000001", tmp_path)
        stock_load(s3, NS, 1, "step-000001", tmp_path)  # resharded, still stock


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_two_nodes_drain_their_own_files_metadata_last(
    s3: moto_s3.S3Bucket, tmp_path: Path, compression: str
) -> None:
    with cluster(2, persistent(s3, compression=compression)) as c:
        save_job(c, 4, 2, ["step-000002"], tmp_path, 11)
        c.wait_state("step-000002", "DURABLE")
        assert s3_names(s3, NS, "step-000002") == _memory_names(c, "step-000002")
        for i in range(2):
            assert "persistent" in c.rows(i)["step-000002"]["tiers"]
        stock_load(s3, NS, 4, "step-000002", tmp_path)
        stock_load(s3, NS, 2, "step-000002", tmp_path)


def test_every_nth_checkpoint_is_drained_and_a_restart_resumes(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    with cluster(1, persistent(s3, every=2)) as c:
        save_job(c, 2, 2, ["step-000001", "step-000002"], tmp_path, 11)
        c.wait_state("step-000002", "DURABLE")
        assert c.rows()["step-000001"]["state"] == "COMMITTED"  # not due
        assert not s3_names(s3, NS, "step-000001")
        # kill -9 before a drain: the restarted daemon rebuilds its queue from manifests.
        c.nodes[0].kill9()
        fs = s3.fs()
        fs.rm(f"{s3.name}/{NS}/step-000002/.metadata")
        c.nodes[0].start()
        c.wait_state("step-000002", "DURABLE")
        # The check of what S3 still holds runs after READY, in the background (audit 3
        # H7): wait, boundedly, for the re-drained `.metadata`.
        deadline = time.monotonic() + 90
        while not fs.exists(f"{s3.name}/{NS}/step-000002/.metadata"):
            assert time.monotonic() < deadline, "the restarted daemon never re-drained"
            time.sleep(0.5)
            fs.invalidate_cache()
        stock_load(s3, NS, 2, "step-000002", tmp_path)


def test_memory_retention_keeps_checkpoints_not_yet_durable(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    bucket = moto_s3.S3Bucket(s3.endpoint_url, name="no-such-bucket")
    overrides = {
        **persistent(bucket),
        "retention": {"memory_keep_last": 1},
    }
    with cluster(1, overrides) as c:
        save_job(c, 1, 1, ["step-000001", "step-000002", "step-000003"], tmp_path, 11)
        # The bucket does not exist: nothing becomes durable, so nothing is evicted.
        rows = c.rows()
        assert sorted(rows) == ["step-000001", "step-000002", "step-000003"]
        assert {r["state"] for r in rows.values()} == {"COMMITTED"}


def _tiered_load(
    c: LocalCluster, world: int, ranks_per_node: int, cid: str | None, expected: Path
) -> None:
    backend = Nodes(NS, c.addresses, ranks_per_node)
    target = str(expected / (cid or "step-000002"))
    results = run_job(jobs.load_and_verify, world, backend, cid, target, timeout=180)
    assert [r["world"] for r in results] == [world] * world


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_every_memory_tier_lost_restores_from_s3(
    s3: moto_s3.S3Bucket, tmp_path: Path, compression: str
) -> None:
    with cluster(2, persistent(s3, compression=compression)) as c:
        save_job(c, 4, 2, ["step-000001", "step-000002"], tmp_path, 11)
        c.wait_state("step-000002", "DURABLE")
        c.wait_state("step-000001", "DURABLE")
        for d in c.nodes:
            d.kill9()
            shutil.rmtree(d.memory_dir, ignore_errors=True)
        for d in c.nodes:
            d.start()
        for i in range(2):
            rows = c.rows(i)
            assert sorted(rows) == ["step-000001", "step-000002"]
            assert rows["step-000002"]["state"] == "DURABLE"
            assert rows["step-000002"]["tiers"] == ["persistent"]
        _tiered_load(c, 4, 2, None, tmp_path)  # newest: only in S3
        _tiered_load(c, 2, 1, "step-000001", tmp_path)  # another world size


class _MetadataLastWatcher:
    """Polls S3 while a drain runs; records any listing with `.metadata` but not all data."""

    def __init__(self, bucket: moto_s3.S3Bucket, checkpoint_id: str, expected: set[str]) -> None:
        self.violations: list[list[str]] = []
        self.saw_metadata = False
        self._stop = threading.Event()
        self._bucket, self._id, self._expected = bucket, checkpoint_id, expected
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fs = self._bucket.fs()
        while not self._stop.is_set():
            fs.invalidate_cache()
            try:
                found = fs.find(f"{self._bucket.name}/{NS}/{self._id}")
                names = {p.rsplit("/", 1)[-1] for p in found}
            except OSError:  # the outage itself
                names = set()
            if ".metadata" in names:
                self.saw_metadata = True
                if names != self._expected:
                    self.violations.append(sorted(names))
                return
            time.sleep(0.05)

    def finish(self) -> list[list[str]]:
        self._thread.join(timeout=30)
        self._stop.set()
        return self.violations


def test_s3_outage_delays_durability_and_loses_nothing(
    s3: moto_s3.S3Bucket, moto_server: moto_s3.MotoServer, tmp_path: Path
) -> None:
    with cluster(2, persistent(s3)) as c:
        moto_server.stop()
        watcher = None
        try:
            save_job(c, 4, 2, ["step-000003"], tmp_path, 11)
            time.sleep(3.0)
            for i in range(2):
                assert c.rows(i)["step-000003"]["state"] in ("COMMITTED", "REPLICATED")
            # From now on, whenever `.metadata` is visible in S3, every data file must be too.
            watcher = _MetadataLastWatcher(s3, "step-000003", _memory_names(c, "step-000003"))
        finally:
            moto_server.restart()
        c.wait_state("step-000003", "DURABLE", timeout=120)
        assert watcher is not None
        assert watcher.finish() == [], "a .metadata was visible before all data files"
        assert watcher.saw_metadata, "the watcher never saw the commit: it checked nothing"
        assert s3_names(s3, NS, "step-000003") == _memory_names(c, "step-000003")
        stock_load(s3, NS, 4, "step-000003", tmp_path)


def test_sigterm_drains_the_newest_checkpoint_before_exit(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    # every = 1000: nothing is due, so only the shutdown drain can put it in S3.
    with cluster(1, persistent(s3, every=1000, shutdown_deadline=60.0)) as c:
        save_job(c, 2, 2, ["step-000001", "step-000002"], tmp_path, 11)
        assert c.rows()["step-000002"]["state"] == "COMMITTED"
        assert not s3_names(s3, NS, "step-000002")
        assert c.nodes[0].terminate(timeout=90) == 0
        assert ".metadata" in s3_names(s3, NS, "step-000002")
        assert not s3_names(s3, NS, "step-000001")  # only the newest
        stock_load(s3, NS, 2, "step-000002", tmp_path)


def test_retention_per_tier(s3: moto_s3.S3Bucket, tmp_path: Path) -> None:
    overrides = {
        **persistent(s3),
        "retention": {
            "memory_keep_last": 2,
            "persistent_keep_last": 3,
            "persistent_keep_every": 5,
        },
    }
    ids = [f"step-{i:06d}" for i in range(1, 11)]
    with cluster(1, overrides) as c:
        save_job(c, 2, 2, ids, tmp_path, 11)
        c.wait_state("step-000010", "DURABLE")
        want_s3 = {"step-000005", "step-000008", "step-000009", "step-000010"}
        want_memory = {"step-000009", "step-000010"}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = c.rows()
            in_memory = {cid for cid, r in rows.items() if "memory" in r["tiers"]}
            in_s3 = {cid for cid, r in rows.items() if "persistent" in r["tiers"]}
            fs = s3.fs()
            fs.invalidate_cache()
            durable = {p.split("/")[-2] for p in fs.glob(f"{s3.name}/{NS}/*/.metadata")}
            if (in_memory, in_s3, durable, set(rows)) == (want_memory, want_s3, want_s3, want_s3):
                break
            time.sleep(0.5)
        assert in_memory == want_memory
        assert in_s3 == want_s3 == durable
        assert set(rows) == want_s3
        assert set(p.name for p in c.nodes[0].data_dir(NS).iterdir()) == want_memory
        _tiered_load(c, 2, 2, "step-000005", tmp_path)  # from S3 only


def test_a_kill_after_the_metadata_upload_still_leaves_the_checkpoint_indexed(
    s3: moto_s3.S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kill -9 right after `.metadata` went up, before the index entry and before this node
    # marked it durable: the restart drains it again (idempotent), so the namespace's
    # durable index (what other clusters list) names it when the catalog says DURABLE.
    monkeypatch.setenv("TIERCKPT_FAULT", "drain.after_metadata:kill")
    with cluster(1, persistent(s3)) as c:
        monkeypatch.delenv("TIERCKPT_FAULT")  # the running daemon read it at start
        save_job(c, 2, 2, ["step-000001"], tmp_path, 11)
        node = c.nodes[0]
        c.wait("the daemon killed at drain.after_metadata", lambda: not node.running)
        fs = s3.fs()
        entry = f"{s3.name}/{NS}/.tierckpt/durable/step-000001"
        fs.invalidate_cache()
        assert fs.exists(f"{s3.name}/{NS}/step-000001/.metadata") and not fs.exists(entry)
        node.start()
        c.wait_state("step-000001", "DURABLE")
        fs.invalidate_cache()
        assert fs.exists(entry)
        stock_load(s3, NS, 2, "step-000001", tmp_path)
