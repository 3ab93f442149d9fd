"""Stock DCP with `tierckpt://` ids through a real tierckptd: no tierckpt in the training code.

The ranks (tests/support/fsspec_jobs.py) import only torch, fsspec and the test's state
helpers, and check that nothing imported tierckpt before their first DCP call: the
`fsspec.specs` entry point is what routes `checkpoint_id="tierckpt://..."` to the daemon.
Each load is bit-exact against a snapshot taken at save time (FSDP2 model, AdamW, a
Stateful loader, RNG state, a replicated tensor). Also: a 3-rank save loaded by 2 ranks; a
second save into a committed id replacing it (DCP's overwrite=True), or refused with
overwrite=False, the committed one intact; loads that
fall through to a peer and to the persistent tier (moto S3) after the node lost its memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from tests.support import fsspec_jobs, moto_s3
from tests.support.cli import ls_json
from tests.support.cluster import local_cluster
from tests.support.dist_job import RankContext, run_job
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "run7"


@pytest.mark.timeout(300)  # ~20 s alone; spawning ranks and DCP's PROCESS child is slow under load
def test_stock_dcp_with_tierckpt_urls(
    daemon: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"TIERCKPT_DAEMON": daemon.address}
    expected = str(tmp_path / "exp")
    # 2 gloo ranks: dcp.save, async_save THREAD and PROCESS, loads, retention, `latest`.
    results = run_job(fsspec_jobs.save_load_retain, 2, NS, expected, 61, timeout=200, env=env)
    for rank, result in enumerate(results):
        assert len(result["leaves"]) == 4 and min(result["leaves"]) >= 20, result
        assert result["load_step"] == 600
        # Retention ran on rank 0 only, the way torchtitan's purge does.
        assert result["removed"] == (
            [["step-000100", "step-000200"], ["epoch=0-step=300"], ["step-000400"]]
            if rank == 0
            else []
        )
    rows = ls_json(daemon.address, NS)
    assert [r["id"] for r in rows] == ["step-000500", "step-000600"]
    assert all(r["state"] == "COMMITTED" for r in rows)
    # Stock DCP layout, committed through the daemon: one file per rank plus .metadata.
    on_disk = sorted(p.name for p in daemon.data_dir(NS, "step-000600").iterdir())
    assert on_disk == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # Another world size: one process, no process group (DCP reshards into a plain model).
    monkeypatch.setenv("TIERCKPT_DAEMON", daemon.address)
    one = fsspec_jobs.load_with_url(
        RankContext(0, 1, str(tmp_path)),
        f"tierckpt://{NS}/step-000600",
        f"{expected}/step-000600",
        77_000,
        training_code=False,
    )
    assert one["world"] == 1 and one["leaves"] >= 20


def test_loads_fall_through_to_a_peer_and_repair_a_corrupt_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One process, no process group; the node that saved loses its RAM, so each file is
    # restored from the peer's replica by the daemon (EnsureLocal), as TieredStorageReader.
    url = f"tierckpt://{NS}/step-000007"
    state = plain_tensor_state(7, 3 << 20)
    expected = snapshot(state)
    with local_cluster(2, namespace=NS, copies=1, heal_interval=3600.0) as c:
        monkeypatch.setenv("TIERCKPT_DAEMON", c.nodes[0].address)
        dcp.save(state, checkpoint_id=url)
        c.wait_state("step-000007", "REPLICATED")
        c.lose(0)
        c.replace(0)
        target = plain_tensor_state(99, 3 << 20)
        dcp.load(target, checkpoint_id=url)
        assert_state_equal(actual=target, expected=expected, what="load through a peer")

        # Flip a byte of the local copy just restored: the read fails its checksum and the
        # daemon replaces the copy from the peer; the load is still bit-exact.
        data = c.nodes[0].data_dir(NS, "step-000007") / "__0_0.distcp"
        os.chmod(data, 0o600)
        with open(data, "r+b") as f:
            f.seek(1 << 20)
            byte = f.read(1)
            f.seek(1 << 20)
            f.write(bytes([byte[0] ^ 0xFF]))
        target = plain_tensor_state(98, 3 << 20)
        dcp.load(target, checkpoint_id=f"tierckpt://{NS}/latest")
        assert_state_equal(actual=target, expected=expected, what="load after a repair")


@pytest.mark.timeout(300)
def test_load_at_another_world_size_in_a_multi_rank_job(daemon: Any, tmp_path: Path) -> None:
    # FSDP2 + AdamW saved by 3 gloo ranks, loaded by 2: DCP reshards every DTensor, and
    # each loading rank's own keys (loader position, RNG) are the ones its rank saved.
    env = {"TIERCKPT_DAEMON": daemon.address}
    url, expected = f"tierckpt://{NS}/step-003000", str(tmp_path / "exp")
    assert run_job(fsspec_jobs.save_with_url, 3, url, expected, 91, timeout=200, env=env) == [3] * 3
    results = run_job(fsspec_jobs.load_with_url, 2, url, expected, 92_000, timeout=200, env=env)
    assert [r["world"] for r in results] == [2, 2]
    assert all(r["leaves"] >= 20 for r in results), results


def test_a_second_save_into_a_committed_id_replaces_it_or_is_refused_when_asked(
    daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stock DCP's default (overwrite=True) re-saves the id as it overwrites a local
    # folder, atomically; FsspecWriter(overwrite=False) keeps the committed one.
    monkeypatch.setenv("TIERCKPT_DAEMON", daemon.address)
    url = f"tierckpt://{NS}/step-000042"
    dcp.save(plain_tensor_state(42, 1 << 20), checkpoint_id=url)
    (first,) = [r["sequence"] for r in ls_json(daemon.address, NS) if r["id"] == "step-000042"]
    second = plain_tensor_state(43, 1 << 20)
    expected = snapshot(second)
    with pytest.warns(UserWarning, match="overwriting"):  # DCP's own warning
        dcp.save(second, checkpoint_id=url)
    (row,) = [r for r in ls_json(daemon.address, NS) if r["id"] == "step-000042"]
    assert row["state"] == "COMMITTED" and row["sequence"] > first
    target = plain_tensor_state(44, 1 << 20)
    dcp.load(target, checkpoint_id=url)
    assert_state_equal(actual=target, expected=expected, what="the re-save")
    with pytest.raises(CheckpointException, match="already exists"):
        dcp.save(plain_tensor_state(45, 1 << 20), storage_writer=FsspecWriter(url, overwrite=False))
    target = plain_tensor_state(46, 1 << 20)
    dcp.load(target, checkpoint_id=url)
    assert_state_equal(actual=target, expected=expected, what="the re-save, after a refused one")


def test_a_load_falls_through_to_the_persistent_tier(
    s3: moto_s3.S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Drained to S3, then the node loses its memory and no peer holds a copy: each file
    # the load opens is fetched from S3 by the daemon and read verified.
    overrides = {"persistent": {"url": s3.url(), "storage_options": dict(s3.storage_options)}}
    url = f"tierckpt://{NS}/step-000009"
    state = plain_tensor_state(9, 2 << 20)
    expected = snapshot(state)
    with local_cluster(1, namespace=NS, overrides=overrides) as c:
        monkeypatch.setenv("TIERCKPT_DAEMON", c.nodes[0].address)
        dcp.save(state, checkpoint_id=url)
        c.wait_state("step-000009", "DURABLE")
        c.lose(0)
        c.replace(0)
        assert not c.nodes[0].data_dir(NS, "step-000009").exists()
        target = plain_tensor_state(10, 2 << 20)
        dcp.load(target, checkpoint_id=f"tierckpt://{NS}/latest")
        assert_state_equal(actual=target, expected=expected, what="load from the persistent tier")
        row = c.rows()["step-000009"]
        assert "memory" in row["tiers"] and "persistent" in row["tiers"], row
