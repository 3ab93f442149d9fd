"""The persistent tier's drain under faults: an S3 outage mid-drain, SIGTERM before a
checkpoint was due, and a kill -9 between `.metadata` and the index entry. Real daemons,
a moto S3 server over HTTP; every checkpoint is loaded back by stock DCP, bit-exact."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.support import moto_s3
from tests.support.cluster import local_cluster, save_job
from tests.support.s3_drain import memory_names, persistent, s3_names, stock_load

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "drain-run"


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
    with local_cluster(2, namespace=NS, overrides=persistent(s3)) as c:
        moto_server.stop()
        watcher = None
        try:
            save_job(c, 4, 2, ["step-000003"], tmp_path, 11)
            time.sleep(3.0)
            for i in range(2):
                assert c.rows(i)["step-000003"]["state"] in ("COMMITTED", "REPLICATED")
            # From now on, whenever `.metadata` is visible in S3, every data file must be too.
            watcher = _MetadataLastWatcher(s3, "step-000003", memory_names(c, "step-000003"))
        finally:
            moto_server.restart()
        c.wait_state("step-000003", "DURABLE", timeout=120)
        assert watcher is not None
        assert watcher.finish() == [], "a .metadata was visible before all data files"
        assert watcher.saw_metadata, "the watcher never saw the commit: it checked nothing"
        assert s3_names(s3, NS, "step-000003") == memory_names(c, "step-000003")
        stock_load(s3, NS, 4, "step-000003", tmp_path)


def test_sigterm_drains_the_newest_checkpoint_before_exit(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    # every = 1000: nothing is due, so only the shutdown drain can put it in S3.
    overrides = persistent(s3, every=1000, shutdown_deadline=60.0)
    with local_cluster(1, namespace=NS, overrides=overrides) as c:
        save_job(c, 2, 2, ["step-000001", "step-000002"], tmp_path, 11)
        assert c.rows()["step-000002"]["state"] == "COMMITTED"
        assert not s3_names(s3, NS, "step-000002")
        assert c.nodes[0].terminate(timeout=90) == 0
        assert ".metadata" in s3_names(s3, NS, "step-000002")
        assert not s3_names(s3, NS, "step-000001")  # only the newest
        stock_load(s3, NS, 2, "step-000002", tmp_path)


def test_a_kill_after_the_metadata_upload_still_leaves_the_checkpoint_indexed(
    s3: moto_s3.S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kill -9 right after `.metadata` went up, before the index entry and before this node
    # marked it durable: the restart drains it again (idempotent), so the namespace's
    # durable index (what other clusters list) names it when the catalog says DURABLE.
    monkeypatch.setenv("TIERCKPT_FAULT", "drain.after_metadata:kill")
    with local_cluster(1, namespace=NS, overrides=persistent(s3)) as c:
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
