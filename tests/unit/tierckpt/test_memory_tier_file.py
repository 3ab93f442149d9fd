"""Both save routes (`TieredStorageWriter` and ``tierckpt://``) write through one
`MemoryTierFile`, which copies each tensor byte once: from the tensor's own memory into
the tmpfs page. Only torch.save's zip framing goes through the coalescing buffer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import CheckpointNotFound
from tierckpt.memory_files import ChecksummingWriter
from tierckpt.memory_tier_file import MemoryTierFile, SaveTarget
from tierckpt.storage_writer import TieredStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "single process"


def _save(route: str, address: str, state: dict[str, torch.Tensor]) -> None:
    if route == "native":
        writer = TieredStorageWriter("copies", daemon=address)
        dcp.save(state, storage_writer=writer, checkpoint_id="step-1")
    else:
        dcp.save(state, checkpoint_id="tierckpt://copies/step-1")


@pytest.mark.parametrize("route", ["native", "tierckpt://"])
def test_each_tensor_byte_is_copied_once(
    route: str, daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERCKPT_DAEMON", daemon.address)
    state = {f"w{i}": torch.randn(1 << 20) for i in range(3)}  # 3 x 4 MiB
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in state.values()]
    seen = {"from the tensor": 0, "through the buffer": 0, "from elsewhere": 0}
    write_hashed = ChecksummingWriter._write_hashed

    def counted(writer: ChecksummingWriter, view: memoryview) -> None:
        """Where os.write reads these bytes from (the tmpfs page is the one copy)."""
        n = view.nbytes
        if isinstance(view.obj, bytearray):
            seen["through the buffer"] += n
        elif n:
            start = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
            inside = any(lo <= start and start + n <= hi for lo, hi in spans)
            seen["from the tensor" if inside else "from elsewhere"] += n
        write_hashed(writer, view)

    monkeypatch.setattr(ChecksummingWriter, "_write_hashed", counted)
    _save(route, daemon.address, state)
    assert seen["from the tensor"] == sum(t.nbytes for t in state.values())
    assert seen["from elsewhere"] == 0
    assert seen["through the buffer"] < 64 << 10  # zip headers, pickles, .metadata
    files = DaemonClient(daemon.address).get_checkpoint("copies", "step-1").files
    assert sum(f.size for f in files) == sum(seen.values())


def test_a_file_that_fails_aborts_its_save(daemon: Any) -> None:
    client = DaemonClient(daemon.address)
    target = SaveTarget("copies", "step-2", 0)
    client.begin_checkpoint(target.namespace, target.checkpoint_id, target.rank)
    committed = MemoryTierFile(client, target, "a.bin", grow=True)
    with committed:
        committed.write(b"a" * 1000)
    with pytest.raises(RuntimeError), MemoryTierFile(client, target, "b.bin", grow=True) as f:
        f.write(b"b" * 1000)
        raise RuntimeError("the writer failed")
    listed = client.list_checkpoints("copies", include_uncommitted=True)
    assert [c.checkpoint_id for c in listed] == []  # aborted, its reservation released
    with pytest.raises(CheckpointNotFound):
        client.get_checkpoint("copies", "step-2")
    assert client.status().reserved_bytes == 0
