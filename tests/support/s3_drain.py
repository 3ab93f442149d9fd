"""Steps the persistent-tier integration tests share: the `[persistent]` table of a moto
bucket, a stock-DCP load straight from it, a tiered load through a cluster's daemons, and
what the bucket and the memory tiers hold of one checkpoint (the gloo save is
`cluster.save_job`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support import jobs, moto_s3
from tests.support.backends import Nodes, StockUrl
from tests.support.cluster import LocalCluster
from tests.support.dist_job import run_job

__all__ = ["memory_names", "persistent", "s3_names", "stock_load", "tiered_load"]


def persistent(bucket: moto_s3.S3Bucket, **keys: Any) -> dict[str, Any]:
    """Config overrides: drain to `bucket` (its moto endpoint), `keys` added to the table."""
    return {
        "persistent": {
            "url": bucket.url(),
            "storage_options": dict(bucket.storage_options),
            **keys,
        }
    }


def stock_load(
    bucket: moto_s3.S3Bucket, namespace: str, world: int, checkpoint_id: str, root: Path
) -> None:
    """Stock DCP (no tierckpt) loads the checkpoint from S3 at `world` ranks, bit-exact
    against what `cluster.save_job` kept under `root`."""
    results = run_job(
        jobs.load_and_verify,
        world,
        StockUrl(bucket.url(namespace)),
        checkpoint_id,
        str(root / checkpoint_id),
        timeout=180,
    )
    assert [r["world"] for r in results] == [world] * world


def s3_names(bucket: moto_s3.S3Bucket, namespace: str, checkpoint_id: str) -> set[str]:
    """The file names the bucket holds of one checkpoint (a fresh listing)."""
    fs = bucket.fs()
    fs.invalidate_cache()
    return {p.rsplit("/", 1)[-1] for p in fs.find(f"{bucket.name}/{namespace}/{checkpoint_id}")}


def memory_names(c: LocalCluster, checkpoint_id: str) -> set[str]:
    """The file names every node's memory tier holds of one checkpoint, together."""
    names: set[str] = set()
    for d in c.nodes:
        directory = d.data_dir(c.namespace, checkpoint_id)
        if directory.is_dir():
            names |= {p.name for p in directory.iterdir()}
    return names


def tiered_load(
    c: LocalCluster,
    world: int,
    ranks_per_node: int,
    checkpoint_id: str,
    root: Path,
    *,
    newest: bool = False,
) -> None:
    """`world` ranks load `checkpoint_id` through the cluster's daemons, bit-exact against
    what `cluster.save_job` kept under `root`; with `newest` they ask for the newest
    checkpoint (no id) and must get that one."""
    backend = Nodes(c.namespace, c.addresses, ranks_per_node)
    asked = None if newest else checkpoint_id
    target = str(root / checkpoint_id)
    results = run_job(jobs.load_and_verify, world, backend, asked, target, timeout=180)
    assert [r["world"] for r in results] == [world] * world
