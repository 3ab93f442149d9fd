"""A save whose second writer thread fails must fail, never commit a checkpoint that
cannot load (found by bench/chaos.py).

torch's FileSystemWriter writes with `thread_count - 1` extra threads and drops their
exceptions; the writer's future then resolves without their items. A real daemon told to
fail one OpenFile (`TIERCKPT_FAULT=save.open_file:error@N`: no file left open for the daemon to notice): whichever thread it hits,
`dcp.save` raises and nothing is listed committed; the next save commits and loads
bit-exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt.daemon_client import DaemonClient
from tierckpt.storage_reader import TieredStorageReader
from tierckpt.storage_writer import TieredStorageWriter
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.daemon_process import DaemonProcess

pytestmark = pytest.mark.integration

NS = "threads"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(64 << 10, generator=g) for i in range(4)}


@pytest.mark.parametrize("failing_commit", [1, 2])
def test_a_failed_writer_thread_fails_the_save(
    monkeypatch: pytest.MonkeyPatch, failing_commit: int
) -> None:
    monkeypatch.setenv("TIERCKPT_FAULT", f"save.open_file:error@{failing_commit}")
    daemon = DaemonProcess(name=f"wt{failing_commit}")
    try:
        with pytest.raises(CheckpointException):
            dcp.save(
                _state(1),
                storage_writer=TieredStorageWriter(NS, daemon=daemon.address, thread_count=2),
                checkpoint_id="step-1",
            )
        client = DaemonClient(daemon.address)
        assert [c.checkpoint_id for c in client.list_checkpoints(NS)] == []
        saved = _state(2)
        dcp.save(
            saved,
            storage_writer=TieredStorageWriter(NS, daemon=daemon.address, thread_count=2),
            checkpoint_id="step-2",
        )
        loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
        dcp.load(loaded, storage_reader=TieredStorageReader(NS, daemon=daemon.address))
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    finally:
        daemon.cleanup()
