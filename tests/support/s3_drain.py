"""Steps the persistent-tier integration tests share: a stock-DCP load straight from the
moto bucket, and what the bucket holds of one checkpoint (the gloo save is
`cluster.save_job`)."""

from __future__ import annotations

from pathlib import Path

from tests.support import jobs, moto_s3
from tests.support.backends import StockUrl
from tests.support.dist_job import run_job

__all__ = ["s3_names", "stock_load"]


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
