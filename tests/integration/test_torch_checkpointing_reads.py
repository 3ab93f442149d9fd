"""torch_checkpointing's mmap fill over `TieredStorage` against a real tierckptd: its
concurrent ranged reads share one open, verified copy of the file (one GetCheckpoint per
fill, not one per range), and every byte stays checked against the block checksums."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing")

from tierckpt.daemon_client import DaemonClient  # noqa: E402
from tierckpt.errors import CheckpointLost, ChecksumMismatch  # noqa: E402
from tierckpt.integrations.torch_checkpointing import StorageConfig  # noqa: E402
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig  # noqa: E402
from torch_checkpointing.storage.torch_serialization import (  # noqa: E402
    load_torch_serialized_from_storage,
)

pytestmark = pytest.mark.integration

NS = "tc-reads"
FILE = "step-1/model_0.pt"


def _saved(daemon: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(8)}  # 8 MiB
    config = StorageConfig(namespace=NS, daemon=daemon.address)
    manager = CheckpointManager(
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)
    )
    try:
        manager.save("step-1", {"model": state})
    finally:
        manager.close()
    return config.create_storage(), state


def test_a_parallel_fill_opens_the_file_once_and_loads_it_exact(
    daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, state = _saved(daemon)
    monkeypatch.setenv("TORCH_CKPT_PARALLEL_FILL_CHUNK_MB", "1")  # 8 ranged reads
    calls: list[str] = []
    real = DaemonClient.get_checkpoint

    def counted(self: DaemonClient, *args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DaemonClient, "get_checkpoint", counted)
    loaded = load_torch_serialized_from_storage(FILE, storage, num_workers=4)
    # getsize, then opens shared by the 8 ranges (one while any range holds the file; a
    # new one only if every worker let go between ranges): 9 with one open per range
    assert calls[0] == "step-1" and 2 <= len(calls) <= 5, calls
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    # the shared copy was closed by the last range: the next fill opens it afresh
    before = len(calls)
    load_torch_serialized_from_storage(FILE, storage, num_workers=4)
    assert 2 <= len(calls) - before <= 5, calls


def test_a_corrupt_block_fails_a_shared_stream_and_spares_the_other(daemon: Any) -> None:
    storage, _ = _saved(daemon)
    path = daemon.data_dir(NS, "step-1") / "model_0.pt"
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 8, 5 << 20)  # inside a tensor, in block 5
    finally:
        os.close(fd)
    with storage.stream_read(FILE) as first, storage.stream_read(FILE) as second:
        second.seek(5 << 20)
        with pytest.raises(ChecksumMismatch, match="model_0.pt"):
            second.read(1 << 20)  # the sole copy is corrupt: no repair can succeed
        # the failed stream let go of the shared file without closing it under `first`
        # (the daemon has dropped the corrupt copy; `first` still reads what it opened)
        first.seek(1 << 20)
        assert len(first.read(1 << 20)) == 1 << 20
        first.seek(5 << 20)
        with pytest.raises(ChecksumMismatch):
            first.read(16)


def test_a_corrupt_sole_copy_fails_the_load_with_its_own_error(
    daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a BufferError from torch_checkpointing closing its mmap while the failure's
    frames still held views of it."""
    storage, _ = _saved(daemon)
    monkeypatch.setenv("TORCH_CKPT_PARALLEL_FILL_CHUNK_MB", "1")
    path = daemon.data_dir(NS, "step-1") / "model_0.pt"
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 8, 5 << 20)
    finally:
        os.close(fd)
    # the parallel fill fails on the corrupt block (the daemon drops that copy); its
    # serial retry finds no copy left
    with pytest.raises((ChecksumMismatch, CheckpointLost), match="model_0.pt"):
        load_torch_serialized_from_storage(FILE, storage, num_workers=4)
