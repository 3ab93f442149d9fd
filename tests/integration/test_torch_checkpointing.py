"""torch_checkpointing's real `CheckpointManager` (CPU configuration, 2 gloo ranks) over
`tierckpt.integrations.torch_checkpointing.StorageConfig`, against two real daemons
(two copies of each file) draining to a moto S3 server.

One cluster serves every step, in order: several ids saved, sync and async; each loaded
bit-exact into fresh ranks; one loaded at another world size through its resharder; the
writer's node lost and a load served from its buddy; the drained copy downloaded and read
by torch_checkpointing's own `LocalFileSystemStorageConfig`; the whole cluster lost and
a load served from S3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import moto_s3, torch_checkpointing_jobs
from tests.support.cluster import local_cluster
from tests.support.dist_job import run_job
from tests.support.s3_drain import memory_names, persistent

pytest.importorskip("torch_checkpointing")  # the `torch-checkpointing` extra (dev has it)

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "tc-run"
IDS = ["step-000001", "step-000002", "step-000003"]  # sync, then async, async
RESHARDED = "resharded-1"


def _load(
    addresses: tuple[str, ...],
    per_node: int,
    world: int,
    checkpoint_id: str,
    root: Path,
    *,
    saved_world: int = 2,
) -> None:
    storage = ("tiered", NS, addresses, per_node)
    results = run_job(
        torch_checkpointing_jobs.load_and_verify,
        world,
        storage,
        checkpoint_id,
        str(root),
        saved_world,
        saved_world != world,
        timeout=300,
    )
    assert [r["world"] for r in results] == [world] * world


@pytest.mark.timeout(900)  # ~80 s alone; a loaded 2-core CI machine is far slower
def test_torch_checkpointing_saves_and_restores_through_every_tier(
    s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    root = tmp_path / "saved"
    with local_cluster(2, namespace=NS, copies=2, overrides=persistent(s3)) as c:
        run_job(
            torch_checkpointing_jobs.save_ids, 2, NS, c.addresses, 1, IDS, str(root), 7, timeout=300
        )
        # A reshardable save (DTensor, DefaultResharder) at one rank: see the job module.
        run_job(
            torch_checkpointing_jobs.save_ids,
            1,
            NS,
            c.addresses,
            1,
            [RESHARDED],
            str(root),
            3,
            True,
            timeout=300,
        )
        for checkpoint_id in IDS:
            c.wait_state(checkpoint_id, "DURABLE", timeout=90.0)
        rows = c.rows(0)
        assert sorted(rows) == sorted([*IDS, RESHARDED])
        assert {rows[i]["format"] for i in IDS} == {"files"}
        names = memory_names(c, "step-000003")
        # Its own layout, flat: per-item per-rank files, and (with a resharder declared)
        # rank 0's metadata.pkl.
        assert {"model_0.pt", "model_1.pt", "extra_0.pt", "extra_1.pt"} <= names
        assert "metadata.pkl" in memory_names(c, RESHARDED)

        # Fresh ranks, one per node, load a sync and an async save bit-exact.
        _load(c.addresses, 1, 2, "step-000001", root)
        _load(c.addresses, 1, 2, "step-000003", root)
        # Another world size: two ranks reshard the one-rank DTensor.
        _load(c.addresses, 1, 2, RESHARDED, root, saved_world=1)

        # The drained copy, downloaded, is read by torch_checkpointing's own backend.
        fs = s3.fs()
        fs.invalidate_cache()
        local = tmp_path / "downloaded" / "step-000002"
        fs.get(f"{s3.name}/{NS}/step-000002/", str(local), recursive=True)
        assert {p.name for p in local.iterdir()} == memory_names(c, "step-000002")
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        results = run_job(
            torch_checkpointing_jobs.load_and_verify,
            2,
            LocalFileSystemStorageConfig(use_direct_io=False),
            str(local),
            str(root),
            2,
            False,
            "step-000002",
            timeout=300,
        )
        assert len(results) == 2

        # The writer of rank 0's files lost with its memory: its buddy serves the load.
        c.lose(0)
        _load(c.addresses[1:], 2, 2, "step-000002", root)

        # The whole cluster lost: the replacements restore from S3.
        c.lose(1)
        c.replace(0, 1)
        c.wait(
            "both nodes to adopt every id from S3",
            lambda: all(len(c.rows(i)) == len(IDS) + 1 for i in range(2)),
            60.0,
        )
        assert c.rows(0)["step-000003"]["tiers"] == ["persistent"]
        _load(c.addresses, 1, 2, "step-000003", root)
