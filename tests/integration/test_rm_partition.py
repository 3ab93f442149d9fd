"""Audit 3 M4: an rm during a partition and an S3 outage is not undone in S3.

Two real daemons and a moto S3 server. node0 coordinates step-1 and its own drain is held
back (a fault point), so only node1, which holds a copy of every file, can make it
durable. The partition is approximated by stopping node1 (SIGSTOP: its port accepts
connections and never answers, as a cut link does). During it, and with S3 stopped, an rm
on node0 answers that it removed the checkpoint here and that node1 is pending. Then S3
comes back, node0 is killed (its memory dir, and so its mark journal, kept) and node1 is
resumed: with its coordinator gone, node1 drains step-1 and commits `.metadata`, as the
audit saw. When node0 returns, its mark reaches node1, which knew step-1 durable: node1
deletes it from S3 again, so the deleted checkpoint does not stay loadable there.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from tierckpt.daemon_client import DaemonClient

from tests.support import moto_s3
from tests.support.cli import cli
from tests.support.cluster import local_cluster
from tests.support.dcp_files import save_checkpoint
from tests.support.raw_rpc import raw_save
from tests.support.s3_drain import s3_names

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "rm-partition"
WAIT = 60.0


@pytest.mark.timeout(300)
def test_an_rm_in_a_partition_and_an_s3_outage_stays_deleted_in_s3(
    s3: moto_s3.S3Bucket,
    moto_server: moto_s3.MotoServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    saved = save_checkpoint(tmp_path / "ckpt")
    files = {n: saved.data(n) for n in saved.data_names}
    files[".metadata"] = saved.metadata
    overrides: dict[str, Any] = {
        "persistent": {
            "url": s3.url(),
            "storage_options": dict(s3.storage_options),
            "owner_grace": 1.0,
        },
        "memory": {"budget": "256MiB"},
    }
    with local_cluster(2, namespace=NS, copies=1, overrides=overrides) as c:
        node0, node1 = c.nodes
        node0.kill9()
        monkeypatch.setenv("TIERCKPT_FAULT", "drain.upload:delay=600")  # node0 never uploads
        node0.start()
        monkeypatch.delenv("TIERCKPT_FAULT")
        client = DaemonClient(node0.address, timeout_s=60)
        try:
            raw_save(client, NS, "step-1", files)
        finally:
            client.close()
        c.wait_state("step-1", "REPLICATED")
        assert not s3_names(s3, NS, "step-1")

        os.kill(node1.pid, signal.SIGSTOP)  # the partition: node1 hears nothing
        try:
            moto_server.stop()  # and S3 is down
            rm = cli(node0.address, "rm", NS, "step-1", check=False)
            assert rm.returncode != 0
            assert "removed here; peers notified (0 applied, pending: node1)" in rm.stderr, (
                rm.stderr
            )
            assert "step-1" not in c.rows(0)
            moto_server.restart()
            c.wait(  # node0's retried delete finds nothing there (nothing drained yet)
                "node0's owed S3 delete done",
                lambda: (
                    "deleted rm-partition/step-1 from the persistent tier"
                    in node0.log_path.read_text(errors="replace")
                ),
                WAIT,
            )
            node0.kill9()  # node1 will find its coordinator gone; node0 keeps its journal
        finally:
            os.kill(node1.pid, signal.SIGCONT)
        c.wait(
            "node1 drains step-1 for its gone coordinator",
            lambda: ".metadata" in s3_names(s3, NS, "step-1"),
            WAIT,
        )
        node0.start()  # the partition heals: node0's rm reaches node1
        c.wait(
            "step-1 deleted from S3 again",
            lambda: ".metadata" not in s3_names(s3, NS, "step-1"),
            WAIT,
        )
        c.wait("no node lists step-1", lambda: all("step-1" not in c.rows(i) for i in range(2)))
        assert not node1.data_dir(NS, "step-1").exists()
