"""Rank functions (for `dist_job.run_job`) driving torch_checkpointing's real
`CheckpointManager` with its CPU configuration over tierckpt's `StorageConfig`, or over
its own `LocalFileSystemStorageConfig` (to read a copy downloaded from S3).

Each checkpoint holds a model tensor split over the ranks, a per-rank plain tensor and a
step; what was saved is kept under `root`, for bit-exact checks. A checkpoint saved
`reshardable` holds the model as a DTensor on the ranks' 1-D CPU mesh with
`DefaultResharder` declared, so a load at another world size reshards it. torch_checkpointing
0.1.1 aggregates a multi-rank save's resharding metadata with CUDA tensors only
(`DefaultMetadataManager._all_gather_pickled_data`), so on CPU a reshardable save runs
at one rank, and its load at two ranks reshards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.dist_job import RankContext

ROWS, COLS = 64, 48


def _full(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, COLS, generator=g)


def _manager(storage: Any, *, sync: bool, reshardable: bool = False) -> Any:
    from torch_checkpointing import (
        AsyncCheckpointSaverConfig,
        CheckpointManager,
        CheckpointStagerConfig,
        ItemSpec,
        SyncCheckpointSaverConfig,
    )
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.default_resharder import DefaultResharder

    # The CPU configuration: no pinned memory, no non-blocking device copies.
    save = (
        SyncCheckpointSaverConfig()
        if sync
        else AsyncCheckpointSaverConfig(
            staging_config=CheckpointStagerConfig(
                use_pinned_memory=False, use_non_blocking_copy=False
            ),
            # Its 30 s default for the write process to start (it imports torch) is too
            # short on a loaded 2-core CI machine.
            process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=180),
        )
    )
    return CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(resharder=DefaultResharder())} if reshardable else {},
            save=save,
            storage_config=storage,
        )
    )


def _tiered(namespace: str, addresses: tuple[str, ...], rank: int, per_node: int) -> Any:
    from tierckpt.integrations.torch_checkpointing import StorageConfig

    return StorageConfig(namespace=namespace, daemon=addresses[rank // per_node])


def _sharded(full: torch.Tensor) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return distribute_tensor(full, mesh, [Shard(0)])


def _model(full: torch.Tensor, rank: int, world: int, reshardable: bool) -> Any:
    return _sharded(full) if reshardable else full.chunk(world)[rank].clone()


def save_ids(
    ctx: RankContext,
    namespace: str,
    addresses: tuple[str, ...],
    per_node: int,
    ids: list[str],
    root: str,
    seed: int,
    reshardable: bool = False,
) -> list[str]:
    """Save `ids` in turn: the first half with the synchronous saver, the rest with the
    asynchronous one (staging, then the background write process)."""
    storage = _tiered(namespace, addresses, ctx.rank, per_node)
    half = max(1, len(ids) // 2)
    managers = {
        sync: _manager(storage, sync=sync, reshardable=reshardable) for sync in (True, False)
    }
    try:
        for i, checkpoint_id in enumerate(ids):
            full = _full(seed + i)
            extra = torch.full((5,), float(seed + i + ctx.rank))
            model = _model(full, ctx.rank, ctx.world_size, reshardable)
            state = {"model": {"w": model}, "extra": extra, "step": seed + i}
            future = managers[i < half].save(checkpoint_id, state)
            if future is not None:
                future.result(timeout=120)
            directory = Path(root, checkpoint_id)
            directory.mkdir(parents=True, exist_ok=True)
            torch.save({"w": full, "extra": extra, "step": seed + i}, directory / f"{ctx.rank}.pt")
    finally:
        for m in managers.values():
            m.close()
    return ids


def load_and_verify(
    ctx: RankContext,
    storage: Any,
    checkpoint_id: str,
    root: str,
    saved_world: int,
    reshardable: bool = False,
    saved_as: str = "",
) -> dict[str, Any]:
    """Load `checkpoint_id` into fresh state at this job's world size (resharded when it
    differs from `saved_world`: a `reshardable` save) and compare it bit-exact with what
    was saved. `storage`: a StorageConfig, or ("tiered", namespace, addresses, per_node)
    for tierckpt's. `saved_as`: the id it was saved under, when `checkpoint_id` is
    another name of it (a local directory it was downloaded to)."""
    if isinstance(storage, tuple):
        _, namespace, addresses, per_node = storage
        storage = _tiered(namespace, addresses, ctx.rank, per_node)
    saved = Path(root, saved_as or checkpoint_id)
    expected = torch.load(saved / "0.pt", weights_only=True)
    manager = _manager(storage, sync=True, reshardable=reshardable)
    zeros = torch.zeros(ROWS, COLS)
    try:
        into: dict[str, Any] = {
            "model": {"w": _model(zeros, ctx.rank, ctx.world_size, reshardable)}
        }
        if ctx.world_size == saved_world:
            into["extra"] = torch.zeros(5)
            into["step"] = None
        loaded = manager.load(checkpoint_id, into=into)
    finally:
        manager.close()
    w = loaded["model"]["w"]
    want = expected["w"] if reshardable else expected["w"].chunk(ctx.world_size)[ctx.rank]
    assert torch.equal(w.full_tensor() if reshardable else w, want), f"{checkpoint_id}: w differs"
    if ctx.world_size == saved_world:
        mine = torch.load(saved / f"{ctx.rank}.pt", weights_only=True)
        assert torch.equal(loaded["extra"], mine["extra"]), f"{checkpoint_id}: extra differs"
        assert loaded["step"] == mine["step"]
    return {"world": ctx.world_size, "id": checkpoint_id}
