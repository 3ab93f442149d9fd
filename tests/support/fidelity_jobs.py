"""Rank bodies of the replica fidelity test: a state of DTensors (a gloo DeviceMesh on CPU)
in every low-precision dtype torch has, saved once and loaded from many copies.

Every value is a function of (dtype, position): float8 tensors are random bytes viewed as
the dtype (NaN and infinity patterns included, which is why comparisons are on bytes),
bfloat16 a seeded normal. The DTensors are built from their local shards
(`DTensor.from_local`), so no collective ever carries a float8 tensor (gloo has none).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from tests.support.backends import Backend
from tests.support.dist_job import RankContext

__all__ = ["DTYPES", "load_each", "save_state"]

# Every float8 variant torch has, and bfloat16.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "bfloat16",
    )
    if hasattr(torch, name)
}
ROWS, COLS = 64, 1000  # per rank: 64 KB of each 1-byte dtype


def _full(name: str, dtype: torch.dtype, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    shape = (world * ROWS, COLS)
    if dtype.itemsize == 1:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def _state(ctx: RankContext, blank: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    state: dict[str, Any] = {}
    for name, dtype in DTYPES.items():
        full = _full(name, dtype, ctx.world_size)
        local = full[ctx.rank * ROWS : (ctx.rank + 1) * ROWS].clone()
        if blank:
            local = _zeros_like(local)
        state[f"dt.{name}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        # A plain tensor of the dtype too (every rank holds it whole; rank 0 writes it).
        plain = full[:8].clone()
        state[f"plain.{name}"] = _zeros_like(plain) if blank else plain
    return state


def _zeros_like(tensor: torch.Tensor) -> torch.Tensor:
    """All-zero bytes of the tensor's dtype and shape (no float8 arithmetic needed)."""
    raw = torch.zeros(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
    return raw.view(tensor.dtype).reshape(tensor.shape)


def _bytes(value: Any) -> torch.Tensor:
    tensor = value.to_local() if isinstance(value, DTensor) else value
    return tensor.contiguous().view(torch.uint8)


def save_state(ctx: RankContext, backend: Backend, checkpoint_id: str) -> None:
    backend.save(_state(ctx, blank=False), checkpoint_id)


def load_each(
    ctx: RankContext, sources: list[tuple[str, Any]], checkpoint_id: str
) -> dict[str, int]:
    """Load the checkpoint from each source into a zeroed state of the same layout and
    compare every byte with what was saved; {label: bytes compared}. A source is a DCP
    directory on the shared filesystem (a copy assembled from one node's files), or a
    backend (tierckpt through a daemon, stock DCP from S3)."""
    expected = _state(ctx, blank=False)
    checked: dict[str, int] = {}
    for label, source in sources:
        target = _state(ctx, blank=True)
        if isinstance(source, str):
            dcp.load(target, storage_reader=dcp.FileSystemReader(source))
        else:
            source.load(target, checkpoint_id)
        total = 0
        for key, value in expected.items():
            want, got = _bytes(value), _bytes(target[key])
            assert torch.equal(want, got), f"{label}: {key} differs after the load"
            total += want.numel()
        checked[label] = total
    return checked
