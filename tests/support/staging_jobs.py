"""Rank functions for tests/integration/test_async_staging.py (spawned ranks import them
by module name): several `dcp.async_save`s in one job, each through a new writer."""

from __future__ import annotations

from typing import Any

from tests.support.backends import Tiered
from tests.support.dist_job import RankContext
from tests.support.jobs import _train_one_more_step, _wait_async, load_and_verify
from tests.support.state_dicts import build_state, save_expected

__all__ = ["async_saves_with_new_writers"]


def _buffer_pointers(namespace: str) -> list[list[int]]:
    """Data pointers of every staging buffer set the registry holds for `namespace`."""
    import torch
    from tierckpt import staging

    def pointers(obj: Any) -> list[int]:
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", obj)  # DTensor: its local shard
            return [local.data_ptr()] if local.numel() else []
        if isinstance(obj, dict):
            return [p for v in obj.values() for p in pointers(v)]
        if isinstance(obj, (list, tuple)):
            return [p for v in obj for p in pointers(v)]
        return []

    slot = staging._REGISTRY._slots.get(namespace)
    return [] if slot is None else [pointers(s.buffers) for s in slot.sets]


def _stager(kind: str | None) -> Any:
    """torch's own stager, as a user would pass it (CPU-only: no pinned, no non-blocking)."""
    if kind is None:
        return None
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=True,
            use_async_staging=kind == "default-async",
            use_non_blocking_copy=False,
        )
    )


def async_saves_with_new_writers(
    ctx: RankContext,
    namespace: str,
    address: str,
    executor: str,
    checkpoint_ids: list[str],
    expected_root: str,
    seed: int,
    stager: str | None = None,
) -> dict[str, Any]:
    """async_save each id through a new TieredStorageWriter, training between saves (and
    during each upload); then load every checkpoint into different state, bit-exact.

    `stager`: None (the writer stages), "default-async" or "default-sync" (a DefaultStager
    passed as `async_stager`, so DCP never calls the writer's stage()).
    """
    import torch.distributed.checkpoint as dcp
    from tierckpt import TieredStorageWriter, staging_stats
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
    src = build_state(seed, ctx.rank)
    pointers: list[list[list[int]]] = []
    responses: list[str] = []
    for checkpoint_id in checkpoint_ids:
        save_expected(src.state_dict, f"{expected_root}/{checkpoint_id}", ctx.rank)
        async_stager = _stager(stager)
        response = dcp.async_save(
            src.state_dict,
            checkpoint_id=checkpoint_id,
            storage_writer=TieredStorageWriter(namespace, daemon=address),
            async_checkpointer_type=kind[executor],
            async_stager=async_stager,
        )
        responses.append(type(response).__name__)
        # The next step changes every parameter while the upload runs, as training does.
        _wait_async(response, mutate=lambda: _train_one_more_step(src))
        if async_stager is not None:
            async_stager.close()  # user-provided stagers are the caller's to close
        pointers.append(_buffer_pointers(namespace))
    backend = Tiered(namespace, address)
    for checkpoint_id in checkpoint_ids:
        load_and_verify(ctx, backend, checkpoint_id, f"{expected_root}/{checkpoint_id}")
    stats = staging_stats()
    return {
        "pointers": pointers,
        "allocations": stats.allocations,
        "reuses": stats.reuses,
        "buffer_sets": stats.buffer_sets,
        "responses": responses,
    }
