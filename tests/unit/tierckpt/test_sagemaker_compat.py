"""`tierckpt.compat.sagemaker` and `tierckpt.sagemaker_import` without a daemon: the seed's
step rule, config checks and exceptions; the importer's decoding of the seed's pickled
metadata (allow-list, never plain pickle) and a file:// import that stock DCP loads."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt import cli
from tierckpt.compat.sagemaker import (
    SageMakerCheckpointConfig,
    SageMakerInMemoryTierError,
    SageMakerS3TierError,
    SageMakerTieredStorageConfigError,
    SageMakerTieredStorageError,
    SageMakerTieredStorageReader,
    SageMakerTieredStorageWriter,
    _set_base_path,
    step_from,
)
from tierckpt.errors import CheckpointNotFound, UnsafeMetadata
from tierckpt.sagemaker_import import converted_metadata, import_sagemaker, seed_steps
from tierckpt.trust import Trust

from tests.support import sagemaker_seed

DAEMON = "unix:///nonexistent/tierckpt-test.sock"  # never contacted: clients connect lazily


def _config(**kw: Any) -> SageMakerCheckpointConfig:
    return SageMakerCheckpointConfig(**{"namespace": "job-1", "world_size": 2, **kw})


@pytest.mark.parametrize(
    ("path", "step", "expected"),
    [
        ("step_0", -1, 0),
        ("step_100", -1, 100),
        ("/path/to/step_42/checkpoint", -1, 42),
        ("any_path", 0, 0),
        ("any_path", 123, 123),
        ("step_999", 42, 42),  # an explicit step wins
    ],
)
def test_step_rule_is_the_seeds(path: str, step: int, expected: int) -> None:
    assert step_from(step, path) == expected
    writer = SageMakerTieredStorageWriter(_config(), path=path, step=step, daemon=DAEMON)
    assert writer.step == expected
    assert writer.checkpoint_id == f"step_{expected}"


@pytest.mark.parametrize(("path", "step"), [("", -1), ("no_step_here", -1), ("step_x", -1)])
def test_no_step_raises_the_seeds_error(path: str, step: int) -> None:
    with pytest.raises(SageMakerTieredStorageError, match="Invalid step value"):
        SageMakerTieredStorageWriter(_config(), path=path, step=step, daemon=DAEMON)


@pytest.mark.parametrize(
    "fields",
    [
        {"namespace": ""},
        {"world_size": 0},
        {"world_size": -1},
        {"save_to_s3": True},
        {"save_to_s3": True, "s3_tier_base_path": "/local/dir"},
        {"namespace": "has space"},
        {"namespace": "x" * 129},
    ],
)
def test_invalid_configs_raise_config_errors(fields: dict[str, Any]) -> None:
    for build in (
        lambda: SageMakerTieredStorageWriter(_config(**fields), step=1, daemon=DAEMON),
        lambda: SageMakerTieredStorageReader(_config(**fields), daemon=DAEMON),
    ):
        with pytest.raises(SageMakerTieredStorageConfigError):
            build()


def test_s3_path_strategy_is_exclusive_and_unsupported() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        _config(s3_tier_base_path="s3://b/p", s3_path_strategy=object())
    with pytest.raises(SageMakerTieredStorageConfigError, match="not supported"):
        SageMakerTieredStorageWriter(_config(s3_path_strategy=object()), step=1, daemon=DAEMON)


def test_exception_hierarchy_is_the_seeds() -> None:
    for cls in (
        SageMakerInMemoryTierError,
        SageMakerS3TierError,
        SageMakerTieredStorageConfigError,
    ):
        assert issubclass(cls, SageMakerTieredStorageError)
        assert pickle.loads(pickle.dumps(cls("m"))).args == ("m",)  # DCP gathers them
    assert issubclass(SageMakerTieredStorageError, Exception)


def test_writer_ignores_dcp_ids_snapshots_save_to_s3_and_pickles() -> None:
    config = _config(s3_tier_base_path="s3://bucket/prefix/", save_to_s3=True)
    writer = SageMakerTieredStorageWriter(config, step=7, daemon=DAEMON)
    config.save_to_s3 = False  # the README flips it for the next step's writer
    writer.reset("something-else")
    assert writer.checkpoint_id == "step_7" and writer.save_to_s3
    assert writer.durable  # save_to_s3 is the commit's "make this one durable" hint
    assert writer.s3_checkpoint_dir == "s3://bucket/prefix/job-1/step_7"
    clone = pickle.loads(pickle.dumps(writer))  # AsyncCheckpointerType.PROCESS
    assert clone.checkpoint_id == "step_7" and clone.namespace == "job-1" and clone.durable
    assert not SageMakerTieredStorageWriter(config, step=8, daemon=DAEMON).durable


def test_reader_step_names_the_checkpoint() -> None:
    reader = SageMakerTieredStorageReader(_config(), step=500, daemon=DAEMON)
    reader.reset("ignored")
    assert reader.checkpoint_id == "step_500"
    newest = SageMakerTieredStorageReader(_config(), daemon=DAEMON)
    newest.reset()
    assert newest.step is None and newest.checkpoint_id == ""


class _Listing:
    """A daemon client that only lists (the reader's `newest_step` asks nothing else)."""

    address = DAEMON

    def __init__(self, rows: list[tuple[str, str]]) -> None:
        self.rows = rows

    def list_checkpoints(self, namespace: str) -> list[Any]:
        return [
            SimpleNamespace(
                checkpoint_id=cid,
                state="COMMITTED" if state == "BAD" else state,
                tiers=("foreign",) * (state == "X"),
                trust=Trust.BAD if state == "BAD" else None,  # `tierckpt mark ... bad`
            )
            for cid, state in self.rows
        ]


def test_a_reader_without_a_base_path_leaves_the_namespace_url_alone() -> None:
    """Only writers reset the namespace's persistent URL when s3_tier_base_path is unset:
    a restore tool without one must not redirect a running job's drain."""
    calls: list[tuple[str, str]] = []
    client = SimpleNamespace(
        address=DAEMON,
        set_namespace=lambda ns, persistent_url: calls.append((ns, persistent_url)),
    )
    _set_base_path(client, _config(), reset=False)  # type: ignore[arg-type]
    assert calls == []
    _set_base_path(client, _config())  # type: ignore[arg-type]
    _set_base_path(client, _config(s3_tier_base_path="s3://b/p"), reset=False)  # type: ignore[arg-type]
    assert calls == [("job-1", ""), ("job-1", "s3://b/p")]


def test_step_none_passes_over_lost_steps() -> None:
    """After a node loss the newest step may be LOST (a file on no tier): step=None takes
    the newest whole step, as the seed falls back to an older one."""
    reader = SageMakerTieredStorageReader(_config(), daemon=DAEMON)
    reader.client = _Listing(  # type: ignore[assignment]
        [("step_10", "DURABLE"), ("step_30", "LOST"), ("step_20", "COMMITTED"), ("other", "X")]
    )
    assert reader.newest_step() == 20
    # A step a peer published into a namespace its node does not write: never the newest.
    reader.client = _Listing([("step_10", "COMMITTED"), ("step_99999999", "X")])  # type: ignore[assignment]
    assert reader.newest_step() == 10
    # A step marked bad (NaN, a failed SDC check): never the newest either.
    reader.client = _Listing([("step_10", "COMMITTED"), ("step_20", "BAD")])  # type: ignore[assignment]
    assert reader.newest_step() == 10
    reader.client = _Listing([("step_30", "LOST")])  # type: ignore[assignment]
    with pytest.raises(SageMakerTieredStorageError, match=r"whole \(LOST: 30\)"):
        reader.newest_step()


# ---- the importer -------------------------------------------------------------------------


def _seed_metadata(module: str) -> bytes:
    """A seed `metadata.metadata` whose storage infos are pickled under `module`."""
    saved = sagemaker_seed.SEED_MODULE
    sagemaker_seed.SEED_MODULE = module
    try:
        fs = fsspec.filesystem("memory")
        sagemaker_seed.seed_save(fs, "/m", "ns", 1, [{"a": torch.arange(4.0)}])
        return bytes(fs.cat_file("/m/ns/rank_0/step_1/metadata.metadata"))
    finally:
        sagemaker_seed.SEED_MODULE = saved
        fsspec.filesystem("memory").rm("/m", recursive=True)


@pytest.mark.parametrize(
    "module",
    [
        "amzn_sagemaker_checkpointing.checkpointing.filesystem.storage_info",
        "amzn_sagemaker_checkpointing.checkpointing.filesystem.filesystem",
    ],
)
def test_seed_metadata_converts_without_the_seed(module: str) -> None:
    body, items = converted_metadata(_seed_metadata(module), "m")
    assert list(items) == [0]
    assert not any(m.startswith("amzn_sagemaker_checkpointing") for m in sys.modules)
    from tierckpt.dcp_metadata import load_metadata

    md = load_metadata(body)
    assert {i.relative_path for i in md.storage_data.values()} == {"__0_0.distcp"}


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned",))


def test_a_hostile_metadata_is_refused_unrun() -> None:
    with pytest.raises(UnsafeMetadata):
        converted_metadata(pickle.dumps(_Evil()), "evil")
    with pytest.raises(UnsafeMetadata, match="storage info"):
        # A stock DCP `.metadata` is not the seed's: its items are _StorageInfo.
        fs = fsspec.filesystem("memory")
        path = "/stock-h7"
        dcp.save({"a": torch.ones(2)}, checkpoint_id=f"memory://{path}", no_dist=True)
        converted_metadata(bytes(fs.cat_file(f"{path}/.metadata")), "stock")


def test_file_url_import_loads_with_stock_dcp(tmp_path: Path) -> None:
    fs = fsspec.filesystem("file", auto_mkdir=True)
    base = str(tmp_path / "seed")
    states = [{"w0": torch.randn(5, 3), "n": 3}, {"w1": torch.arange(7, dtype=torch.int32)}]
    sagemaker_seed.seed_save(fs, base, "job-1", 4, states)
    fs.makedirs(f"{base}/job-1/rank_0/step_8", exist_ok=True)  # never committed: skipped
    assert seed_steps(fs, f"{base}/job-1") == {4: {0, 1}, 8: {0}}
    done = import_sagemaker(f"file://{base}", "job-1", dest_url=f"file://{tmp_path / 'dst'}")
    assert [(r.checkpoint_id, r.files, r.skipped) for r in done] == [("step_4", 3, False)]
    target = {"w0": torch.zeros(5, 3), "n": 0, "w1": torch.zeros(7, dtype=torch.int32)}
    dcp.load(target, checkpoint_id=str(tmp_path / "dst" / "job-1" / "step_4"), no_dist=True)
    assert torch.equal(target["w0"], states[0]["w0"]) and target["n"] == 3
    assert torch.equal(target["w1"], states[1]["w1"])
    # The durable index entry and bookkeeping the daemon's discovery reads.
    assert (tmp_path / "dst" / "job-1" / ".tierckpt" / "durable" / "step_4").exists()
    book = tmp_path / "dst" / ".tierckpt" / "job-1" / "step_4"
    assert sorted(p.name for p in book.iterdir()) == ["files", "manifest.json", "metadata.orig"]
    with pytest.raises(CheckpointNotFound, match="found steps: 4, 8"):
        import_sagemaker(f"file://{base}", "job-1", steps=[5])
    assert cli.main(["import-sagemaker", f"file://{base}", "job-1", "--steps", "8"]) == 1


def test_a_rerun_repairs_an_import_cut_off_before_its_index_entry(tmp_path: Path) -> None:
    """A crash between `.metadata` and the index entry: the step is committed but the
    namespace's listing (the durable index) would miss it; the re-run writes the entry."""
    fs = fsspec.filesystem("file", auto_mkdir=True)
    base, dst = str(tmp_path / "seed"), tmp_path / "dst"
    for step in (4, 6):
        sagemaker_seed.seed_save(fs, base, "job-1", step, [{"w": torch.full((3,), float(step))}])
    import_sagemaker(f"file://{base}", "job-1", dest_url=f"file://{dst}")
    entry = dst / "job-1" / ".tierckpt" / "durable" / "step_6"
    entry.unlink()  # as if the run died right after step_6/.metadata
    done = import_sagemaker(f"file://{base}", "job-1", dest_url=f"file://{dst}")
    assert [(r.checkpoint_id, r.skipped) for r in done] == [("step_4", True), ("step_6", True)]
    assert entry.exists()
    assert sorted(p.name for p in entry.parent.iterdir()) == ["step_4", "step_6"]
