"""`tierckpt.integrations.torch_checkpointing`: how paths map to namespaces, ids and
files, and the calls a tiered store refuses before asking any daemon (a daemon-backed run
of the real CheckpointManager: tests/integration/test_torch_checkpointing.py)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

pytest.importorskip("torch_checkpointing")

from tierckpt.errors import InvalidName  # noqa: E402
from tierckpt.integrations.torch_checkpointing import (  # noqa: E402
    StorageConfig,
    TieredStorage,
    UnsupportedOnTieredStore,
)


def _storage(namespace: str = "run7") -> TieredStorage:
    return StorageConfig(namespace=namespace, daemon="/nonexistent.sock").create_storage()


def test_ids_and_urls_name_a_namespace_and_a_checkpoint() -> None:
    s = _storage()
    assert s.remap_path(Path("step-10")) == "tierckpt://run7/step-10"
    assert s.remap_path(Path("tierckpt://other/run1/step-10")) == "tierckpt://other/run1/step-10"
    assert s._as_file(s._parse(Path("tmp_step-10/model_0.pt"))) == ("step-10", "model_0.pt", True)
    assert s._as_file(s._parse("run1/step-10/model_0.pt")) == ("run1/step-10", "model_0.pt", False)
    assert s._as_temp_dir(s._parse("run1/tmp_step-10")) == "run1/step-10"


@pytest.mark.parametrize("bad", ["/ckpt/step-10", "step-10/../../x", "tierckpt://../x"])
def test_local_paths_and_escapes_are_refused(bad: str) -> None:
    with pytest.raises(InvalidName):
        _storage()._as_file(_storage()._parse(bad + "/f"))


def test_an_id_without_a_namespace_is_refused() -> None:
    with pytest.raises(InvalidName, match="namespace"):
        _storage("")._parse("step-10")


def test_what_a_tiered_store_cannot_do_fails_before_any_rpc() -> None:
    s = _storage()
    with pytest.raises(UnsupportedOnTieredStore, match="temporary directory"):
        s.stream_write(Path("step-10/model_0.pt"))  # write_to_temp_dir=False
    with pytest.raises(UnsupportedOnTieredStore, match="cannot rename"):
        s.rename(Path("step-10"), Path("step-11"), is_directory=True)
    with pytest.raises(UnsupportedOnTieredStore, match="cannot rename"):
        s.rename(Path("tmp_step-10"), Path("step-11"), is_directory=True)
    with pytest.raises(UnsupportedOnTieredStore, match="one by one"):
        s.delete(Path("step-10/model_0.pt"))
    with pytest.raises(UnsupportedOnTieredStore, match="subdirectory"):
        s.stream_write(Path("tmp_step-10/model/shard_0.pt"))


def test_the_config_carries_rank_and_store_to_the_write_process() -> None:
    config = StorageConfig(namespace="run7")
    copy = pickle.loads(pickle.dumps(config))
    assert copy.coordinates() == (0, 1, None)  # no process group here: one rank
    assert copy.namespace == "run7"
    with pytest.raises(InvalidName):
        StorageConfig(namespace="../x")
