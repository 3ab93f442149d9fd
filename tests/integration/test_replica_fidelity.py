"""Replica fidelity (issue 28 point 5): a state of DTensors on a gloo DeviceMesh (2 ranks
on CPU) in every float8 variant torch has and bfloat16, saved through 3 real daemons with
`copies = 2` and drained to moto S3 (no compression): every replica and the drained copy
are byte-identical to the primary, and a load from each copy is bit-exact.

"Each copy": for k = 0, 1, 2 a DCP directory assembled from the k-th holder of every file
(its owner, then its replicas, read from their memory dirs) and loaded with stock DCP;
the drained copy loaded with stock DCP from S3; and a tiered load through each daemon.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierckpt.daemon_client import DaemonClient

from tests.support import moto_s3
from tests.support.backends import Nodes, StockUrl
from tests.support.cluster import LocalCluster, local_cluster
from tests.support.dist_job import run_job
from tests.support.fidelity_jobs import DTYPES, load_each, save_state
from tests.support.s3_drain import persistent

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "fidelity"
CID = "step-1"
WORLD = 2


@pytest.fixture
def cluster(s3: moto_s3.S3Bucket) -> Iterator[LocalCluster]:
    with local_cluster(
        3,
        namespace=NS,
        copies=2,
        heal_interval=1.0,
        overrides=persistent(s3, compression="none"),
    ) as c:
        yield c


@pytest.mark.timeout(420)
def test_every_replica_and_the_drained_copy_are_the_primary_byte_for_byte(
    cluster: LocalCluster, s3: moto_s3.S3Bucket, tmp_path: Path
) -> None:
    assert {"float8_e4m3fn", "float8_e5m2", "bfloat16"} <= set(DTYPES), DTYPES
    # Rank r writes through node r; node 0 coordinates.
    run_job(save_state, WORLD, Nodes(NS, cluster.addresses, 1), CID, timeout=180)
    client = DaemonClient(cluster.nodes[0].address, timeout_s=30)
    try:
        seen: list[str] = []

        def settled() -> bool:
            info = client.get_checkpoint(NS, CID)
            seen[:] = [f"{info.state} {info.tiers}"] + [
                f"{f.name}: {f.owner_node} {f.replica_nodes}" for f in info.files
            ]
            return info.state == "DURABLE" and all(len(f.replica_nodes) == 2 for f in info.files)

        try:
            cluster.wait("every file on 3 nodes and the checkpoint DURABLE", settled, timeout=90)
        except AssertionError as e:
            raise AssertionError(f"{seen}\n{e}") from None
        info = client.get_checkpoint(NS, CID)
    finally:
        client.close()

    by_name = {d.name: d for d in cluster.nodes}
    fs = s3.fs()
    fs.invalidate_cache()
    copies: list[Path] = [tmp_path / f"copy{k}" for k in range(3)]
    for directory in copies:
        directory.mkdir()
    compared = 0
    for f in info.files:
        holders = [f.owner_node, *f.replica_nodes]
        assert len(set(holders)) == 3, f"{f.name} on {holders}"
        paths = [by_name[h].data_dir(NS, CID) / f.name for h in holders]
        primary = paths[0].read_bytes()
        assert len(primary) == f.size, f"{f.name}: {len(primary)} bytes on disk, {f.size} listed"
        for holder, path in zip(holders[1:], paths[1:], strict=True):
            assert path.read_bytes() == primary, f"{f.name}: the replica on {holder} differs"
        drained = fs.cat_file(f"{s3.name}/{NS}/{CID}/{f.name}")
        assert drained == primary, f"{f.name}: the drained copy differs from the primary"
        for k, path in enumerate(paths):
            shutil.copyfile(path, copies[k] / f.name)
        compared += len(primary)
    assert compared > len(DTYPES) * WORLD * 64_000, compared

    sources: list[tuple[str, object]] = [(f"copy {k}", str(d)) for k, d in enumerate(copies)]
    sources.append(("S3, stock DCP", StockUrl(s3.url(NS))))
    sources += [
        (f"tiered via {d.name}", Nodes(NS, (d.address, d.address), WORLD)) for d in cluster.nodes
    ]
    results = run_job(load_each, WORLD, sources, CID, timeout=240)
    for rank, checked in enumerate(results):
        assert set(checked) == {label for label, _ in sources}, checked
        assert all(n > 0 for n in checked.values()), (rank, checked)
    print(
        f"{compared} bytes in {len(info.files)} files identical on 3 nodes and S3; loads: "
        f"{results[0]}"
    )
