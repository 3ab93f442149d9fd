"""Migrating from SageMaker's checkpointing client, end to end: moto S3 over HTTP, real daemons.

- `tierckpt import-sagemaker` on checkpoints in the seed's S3 layout (re-created by
  `tests.support.sagemaker_seed` from its documented writer: two ranks, tensors and
  BYTE_IO items): stock `dcp.load` from the persistent URL and tierckpt restores (the
  compat reader with ``step=None`` on a daemon whose own ``[persistent] url`` is elsewhere:
  it finds them under ``s3_tier_base_path``; then by id) are bit-exact; the seed's AWS
  packages are never imported.
- The seed's README example with only its import line changed, on 2 gloo ranks against a
  daemon whose ``[persistent] url`` is another prefix and whose ``allowed_urls`` admit the
  job's ``s3_tier_base_path``: its ``save_to_s3`` steps land under that path (per-job, as
  in the seed), nothing under the daemon's URL, and the newest restores bit-exact with
  ``step=None``.
- ``save_to_s3`` with a base path the daemon does not allow, or with no persistent tier:
  `SageMakerS3TierError` from the save before anything is written, never a silently
  dropped copy.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt import cli
from tierckpt.compat.sagemaker import (
    SageMakerCheckpointConfig,
    SageMakerS3TierError,
    SageMakerTieredStorageReader,
    SageMakerTieredStorageWriter,
)
from tierckpt.storage_reader import TieredStorageReader
from torch.distributed.checkpoint.api import CheckpointException

from tests.support import moto_s3, sagemaker_seed
from tests.support.daemon_process import DaemonProcess
from tests.support.dist_job import run_job

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "sm-job"


def _rank_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        f"r{rank}.weight": torch.randn(129, 33, generator=g),
        f"r{rank}.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        f"r{rank}.count": torch.tensor(step * 10 + rank, dtype=torch.int64),
        f"r{rank}.extra": {"rank": rank, "lr": 0.1 * (step + 1), "name": f"step {step}"},
    }


def _template(step: int, ranks: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for rank in ranks:
        for key, value in _rank_state(rank, step).items():
            if isinstance(value, torch.Tensor):
                state[key] = torch.zeros_like(value)
            else:  # BYTE_IO leaves: DCP replaces them
                state[key] = {"rank": -1, "lr": 0.0, "name": ""}
    return state


def _expected(step: int) -> dict[str, Any]:
    return {**_rank_state(0, step), **_rank_state(1, step)}


def _assert_bit_exact(loaded: dict[str, Any], step: int) -> None:
    assert sagemaker_seed._equal(loaded, _expected(step)), f"step {step} differs"


def test_import_sagemaker_then_stock_dcp_and_tierckpt_restore_bit_exact(
    s3: moto_s3.S3Bucket, capsys: pytest.CaptureFixture[str]
) -> None:
    fs = s3.fs()
    base = f"{s3.name}/checkpoints"
    for step in (10, 20):
        sagemaker_seed.seed_save(fs, base, NS, step, [_rank_state(0, step), _rank_state(1, step)])
    fs.pipe_file(f"{base}/{NS}/rank_0/step_30/checkpoint.pt", b"never committed")
    assert sagemaker_seed.SEED_MODULE not in sys.modules

    src = s3.url("checkpoints")
    assert cli.main(["import-sagemaker", src, NS]) == 0
    out = capsys.readouterr().out
    assert "step_10: 3 files" in out and "step_20: 3 files" in out and "step_30" not in out
    assert not any(m.startswith("amzn_sagemaker_checkpointing") for m in sys.modules)
    # Server-side copies: the seed's objects are untouched; stock DCP layout beside them.
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{base}/{NS}/step_10"))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert fs.cat_file(f"{base}/{NS}/step_10/__1_0.distcp") == fs.cat_file(
        f"{base}/{NS}/rank_1/step_10/checkpoint.pt"
    )
    # Again: already imported, nothing rewritten.
    assert cli.main(["import-sagemaker", src, NS, "--steps", "10"]) == 0
    assert "step_10: already imported" in capsys.readouterr().out

    for step in (10, 20):
        state = _template(step)
        dcp.load(state, checkpoint_id=f"{src}/{NS}/step_{step}")  # stock FsspecReader
        _assert_bit_exact(state, step)

    daemon = DaemonProcess(_config(s3, s3.url("cluster-default"), [src]), name="sm")
    try:
        reader = SageMakerTieredStorageReader(
            SageMakerCheckpointConfig(namespace=NS, world_size=2, s3_tier_base_path=src),
            daemon=daemon.address,
        )
        state = _template(20)
        dcp.load(state, storage_reader=reader)  # step=None: the highest step in any tier
        assert reader.step == 20
        _assert_bit_exact(state, 20)
        assert set(reader.sources.values()) == {"fetched"}  # restored from S3, verified
        state = _template(10)  # the namespace's URL is set on the daemon now: by id too
        dcp.load(
            state,
            storage_reader=TieredStorageReader(NS, daemon=daemon.address),
            checkpoint_id="step_10",
        )
        _assert_bit_exact(state, 10)
    finally:
        daemon.cleanup()


def _config(s3: moto_s3.S3Bucket, url: str, allowed: list[str], every: int = 1) -> dict[str, Any]:
    options = dict(s3.storage_options)
    return {
        "persistent": {
            "url": url,
            "storage_options": options,
            "every": every,
            "allowed_urls": allowed,
        }
    }


def test_seed_readme_example_with_the_import_changed(s3: moto_s3.S3Bucket) -> None:
    base = s3.url("jobs", "team-a")
    # every = 100: none of the 5 saves is due by `every`; save_to_s3 steps drain anyway
    # (the commit's durable hint), the others stay in memory only.
    config = _config(s3, s3.url("cluster-default"), [s3.url("jobs")], every=100)
    daemon = DaemonProcess(config, name="smx")
    try:
        env = {"TIERCKPT_DAEMON": daemon.address}
        results = run_job(
            sagemaker_seed.readme_example, 2, base, NS, 5, (2, 4), timeout=120, env=env
        )
    finally:
        daemon.cleanup()
    for restored, exact, s3_steps in results:
        assert restored == 4 and exact
        assert s3_steps == [0, 4]
    fs = s3.fs()
    fs.invalidate_cache()
    for step in range(5):  # save_to_s3 steps, and only they, are under s3_tier_base_path
        landed = fs.exists(f"{s3.name}/jobs/team-a/{NS}/step_{step}/.metadata")
        assert landed == (step in (0, 4)), step
    assert not fs.exists(f"{s3.name}/cluster-default/{NS}")  # not the daemon's own URL


def test_save_to_s3_is_never_silently_dropped(s3: moto_s3.S3Bucket) -> None:
    """A base path the daemon does not allow (a sibling prefix, a path trick), or a daemon
    without a persistent tier: SageMakerS3TierError before anything is saved; without
    save_to_s3 the same writer only warns, and saves to memory."""
    state = {"w": torch.arange(10.0)}
    allowing_jobs = _config(s3, s3.url("other"), [s3.url("jobs")], every=100)
    cases = (
        (allowing_jobs, s3.url("jobs-evil"), "allowed_urls"),
        (allowing_jobs, s3.url("jobs") + "/../secret", "invalid persistent URL"),
        (allowing_jobs, "s3://another-bucket/jobs", "allowed_urls"),
        ({}, s3.url("jobs"), "no persistent tier"),
    )
    for overrides, base, expected in cases:
        daemon = DaemonProcess(overrides, name="sm3")
        try:
            config = SageMakerCheckpointConfig(
                namespace=NS, world_size=1, s3_tier_base_path=base, save_to_s3=True
            )
            writer = SageMakerTieredStorageWriter(config, step=5, daemon=daemon.address)
            with pytest.raises(CheckpointException) as raised:
                dcp.save(state, storage_writer=writer)
            ((failure, _),) = raised.value.failures.values()  # (exception, traceback)
            assert isinstance(failure, SageMakerS3TierError), failure
            assert expected in str(failure), failure
            config.save_to_s3 = False
            writer = SageMakerTieredStorageWriter(config, step=6, daemon=daemon.address)
            dcp.save(state, storage_writer=writer)  # memory only: a warning, no error
        finally:
            daemon.cleanup()


def test_step_none_finds_a_newer_step_in_s3_past_an_older_one_in_memory(
    s3: moto_s3.S3Bucket,
) -> None:
    """A replacement node: the job's newest step (4) reached S3 from the node that died;
    the new node then saved an older step (2, memory only: a job that restarted from an
    older copy). step=None must restore 4 from S3, not the newest in memory."""
    base = s3.url("jobs", "team-b")
    config = _config(s3, s3.url("cluster-default"), [s3.url("jobs")], every=100)

    def sm_config(save_to_s3: bool) -> SageMakerCheckpointConfig:
        return SageMakerCheckpointConfig(
            namespace=NS, world_size=1, s3_tier_base_path=base, save_to_s3=save_to_s3
        )

    old = DaemonProcess(config, name="sm-old")
    try:
        writer = SageMakerTieredStorageWriter(sm_config(True), step=4, daemon=old.address)
        dcp.save(_rank_state(0, 4), storage_writer=writer)  # returns once durable
    finally:
        old.cleanup()
    new = DaemonProcess(config, name="sm-new")
    try:
        writer = SageMakerTieredStorageWriter(sm_config(False), step=2, daemon=new.address)
        dcp.save(_rank_state(0, 2), storage_writer=writer)
        reader = SageMakerTieredStorageReader(sm_config(False), daemon=new.address)
        state = _template(4, ranks=(0,))
        dcp.load(state, storage_reader=reader)
        assert reader.step == 4
        assert sagemaker_seed._equal(state, _rank_state(0, 4)), "step 4 differs"
        assert set(reader.sources.values()) == {"fetched"}  # from S3, verified
        # The older step is still there, in memory, by its step.
        older = SageMakerTieredStorageReader(sm_config(False), step=2, daemon=new.address)
        state = _template(2, ranks=(0,))
        dcp.load(state, storage_reader=older)
        assert sagemaker_seed._equal(state, _rank_state(0, 2)), "step 2 differs"
    finally:
        new.cleanup()
