"""The reader's load paths through a real tierckptd, in one process: items read straight
into their destinations as one batch (blocks shared by two items read once), destinations
that need a landing buffer (strided views), items whose saved slice is not one contiguous
run (staged through torch.load), and a corrupt byte in the middle of a large item."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt import ChecksumMismatch, TieredStorageReader
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.backends import Tiered

pytestmark = pytest.mark.integration

NS = "loadpaths"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        # sizes that straddle 1 MiB checksum blocks at odd offsets
        "big": torch.randn(3 * MiB // 4 + 17, generator=g),
        "matrix": torch.randn(700, 1031, generator=g),
        "small": torch.arange(7, dtype=torch.int16),
        "half": torch.randn(333, 1000, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5),
        "extra": {"step": 12, "note": "x"},
    }


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0, "note": ""}
        for k, v in state.items()
    }


def _load(daemon: Any, target: dict[str, Any], ckpt: str, io_threads: int = 2) -> None:
    reader = TieredStorageReader(NS, daemon=daemon.address, io_threads=io_threads)
    dcp.load(target, checkpoint_id=ckpt, storage_reader=reader)


@pytest.mark.parametrize("io_threads", [1, 2, 5])
def test_direct_batch_load_is_bit_exact(daemon: Any, io_threads: int) -> None:
    state = _state()
    Tiered(NS, daemon.address).save(state, "step-000001")
    target = _zeros(state)
    _load(daemon, target, "step-000001", io_threads)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(target[k], v), k
            assert target[k].dtype == v.dtype
    assert target["extra"] == state["extra"]


def test_strided_destinations_go_through_a_landing_buffer(daemon: Any) -> None:
    state = _state()
    Tiered(NS, daemon.address).save(state, "step-000002")
    target = _zeros(state)
    wide = torch.zeros(1031, 700)
    target["matrix"] = wide.t()  # a transposed view: not contiguous, same shape
    padded = torch.zeros(333, 1200, dtype=torch.bfloat16)
    target["half"] = padded[:, 100:1100]  # a strided window into a larger tensor
    _load(daemon, target, "step-000002")
    assert torch.equal(wide.t(), state["matrix"])
    assert torch.equal(padded[:, 100:1100], state["half"])
    assert not padded[:, :100].any() and not padded[:, 1100:].any()  # nothing outside


def test_resharded_pieces_of_a_saved_tensor(daemon: Any) -> None:
    """A load plan asking for row blocks and column blocks of a saved matrix: rows are
    one contiguous run (read direct), columns are not (staged)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    state = {"m": torch.randn(300, 4099)}
    Tiered(NS, daemon.address).save(state, "step-000003")
    reader = TieredStorageReader(NS, daemon=daemon.address, io_threads=2)
    reader.reset("step-000003")
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    index = MetadataIndex("m", offset=torch.Size([0, 0]))
    pieces = {
        "rows": ((100, 0), (57, 4099)),
        "cols": ((0, 1000), (300, 33)),
        "corner": ((299, 4000), (1, 99)),
    }
    items = [
        ReadItem(
            LoadItemType.TENSOR,
            dest_index=MetadataIndex(name),
            dest_offsets=torch.Size([0, 0]),
            storage_index=index,
            storage_offsets=torch.Size(off),
            lengths=torch.Size(n),
        )
        for name, (off, n) in pieces.items()
    ]
    dest = {name: torch.zeros(n) for name, (_, n) in pieces.items()}

    class Planner:
        def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
            return dest[item.dest_index.fqn]

        def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
            assert tensor.data_ptr() == dest[item.dest_index.fqn].data_ptr()

    plan = reader.prepare_local_plan(LoadPlan(items))
    reader.read_data(plan, Planner()).wait()  # type: ignore[arg-type]
    m = state["m"]
    for name, ((r, c), (nr, nc)) in pieces.items():
        assert torch.equal(dest[name], m[r : r + nr, c : c + nc]), name


def test_a_corrupt_byte_inside_a_large_item_fails_the_load(daemon: Any) -> None:
    state = {"big": torch.randn(20 * MiB // 4), "other": torch.randn(5 * MiB // 4)}
    Tiered(NS, daemon.address).save(state, "step-000004")
    files = daemon.data_dir(NS, "step-000004").iterdir()
    (data_file,) = [p for p in files if p.suffix == ".distcp" and p.stat().st_size > 20 * MiB]
    at = 13 * MiB + 12345  # an interior block of "big"
    with open(data_file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    # dcp.load wraps a rank's error in a CheckpointException that quotes it
    with pytest.raises((ChecksumMismatch, CheckpointException)) as info:
        _load(daemon, _zeros(state), "step-000004")
    assert re.search(
        f"ChecksumMismatch: checksum mismatch in .*{data_file.name}, block 13\\b", str(info.value)
    )
