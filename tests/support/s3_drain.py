"""Steps the persistent-tier integration tests share: a gloo job saving through the
cluster's daemons, a stock-DCP load straight from the moto bucket, and what the bucket
holds of one checkpoint."""

from __future__ import annotations

from pathlib import Path

from tests.support import jobs, moto_s3
from tests.support.backends import Nodes, StockUrl
from tests.support.cluster import LocalCluster
from tests.support.dist_job import run_job

__all__ = ["s3_names", "save_job", "stock_load"]


def save_job(
    c: LocalCluster, world: int, ranks_per_node: int, ids: list[str], root: Path, seed: int
) -> None:
    """`world` ranks (`ranks_per_node` on each node) save checkpoints `ids` of
    `c.namespace`; the states they saved are kept under `root` for later checks."""
    backend = Nodes(c.namespace, c.addresses, ranks_per_node)
    run_job(jobs.save_only, world, backend, ids, str(root), seed, timeout=180)


def stock_load(
    bucket: moto_s3.S3Bucket, namespace: str, world: int, checkpoint_id: str, root: Path
) -> None:
    """Stock DCP (no tierckpt) loads the checkpoint from S3 at `world` ranks, bit-exact
    against what `save_job` kept under `root`."""
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
