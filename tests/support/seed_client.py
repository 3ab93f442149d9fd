"""Rank functions driving the real SageMaker client (``amzn-sagemaker-checkpointing``
1.1.3) unchanged: its writer and reader find their daemon at their fixed address,
``http://ai-toolkit-gossip-headless.aws-hyperpod.svc.cluster.local:9200``, which each
rank reaches through ``HTTP_PROXY`` pointed at its own node's `[listen] sagemaker` port
(what the node-local Service does in Kubernetes; the listener takes the absolute-form
request targets a proxied client sends). No client code is patched.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["expected_state", "seed_save_load", "seed_save_retained", "template_state"]


def expected_state(rank: int, step: int) -> dict[str, Any]:
    """What rank `rank` saves at `step`: tensors of its own, a tensor every rank shares
    (DCP stores it once, so the other rank reads it from this one's blob), a BYTE_IO item."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    shared = torch.Generator().manual_seed(step)
    return {
        f"r{rank}.weight": torch.randn(129, 33, generator=g),
        f"r{rank}.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "shared": torch.randn(64, 16, generator=shared),
        f"r{rank}.extra": {"rank": rank, "step": step},
        "step": step,
    }


def template_state(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in expected_state(rank, 0).items():
        out[key] = torch.full_like(value, 999) if isinstance(value, torch.Tensor) else value
    out[f"r{rank}.extra"] = {"rank": -1, "step": -1}
    out["step"] = -1
    return out


def _point_at(port: int) -> None:
    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy"):
        os.environ.pop(name, None)
    os.environ["HTTP_PROXY"] = os.environ["http_proxy"] = f"http://127.0.0.1:{port}"


def seed_save_load(
    ctx: Any, ports: list[int], namespace: str, steps: list[int], load_step: int | None
) -> dict[str, Any]:
    """Save `steps` with the seed writer (a new writer per step, async_save), then load
    with the seed reader (`load_step`, None: the newest); the step loaded and whether
    it is bit-exact with what this rank saved then."""
    import torch.distributed as dist
    from amzn_sagemaker_checkpointing.checkpointing.filesystem import (
        SageMakerTieredStorageReader,
        SageMakerTieredStorageWriter,
    )
    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import (
        SageMakerCheckpointConfig,
    )
    from torch.distributed.checkpoint import async_save, load

    from tests.support.sagemaker_seed import _equal

    _point_at(ports[ctx.rank % len(ports)])
    config = SageMakerCheckpointConfig(namespace=namespace, world_size=ctx.world_size)
    for step in steps:
        writer = SageMakerTieredStorageWriter(checkpoint_config=config, step=step)
        async_save(state_dict=expected_state(ctx.rank, step), storage_writer=writer).result()
        dist.barrier()
    state = template_state(ctx.rank)
    load(
        state, storage_reader=SageMakerTieredStorageReader(checkpoint_config=config, step=load_step)
    )
    step = int(state["step"])
    return {"step": step, "exact": _equal(state, expected_state(ctx.rank, step))}


def seed_load(ctx: Any, ports: list[int], namespace: str, load_step: int | None) -> dict[str, Any]:
    """Only the load of `seed_save_load`."""
    return seed_save_load(ctx, ports, namespace, [], load_step)


def seed_save_retained(
    ctx: Any, ports: list[int], namespace: str, steps: list[int], steps_retained: int
) -> dict[str, Any]:
    """Rank 0 creates the namespace with the client's own `InMemoryCheckpointClient`
    and `steps_retained` (the writer always asks for 3 and offers no knob), then every
    rank saves `steps` with the seed writer and loads the newest."""
    import torch.distributed as dist
    from amzn_sagemaker_checkpointing.storage.clients.inmemory.inmemory_client import (
        InMemoryCheckpointClient,
    )

    _point_at(ports[ctx.rank % len(ports)])
    if ctx.rank == 0:
        client = InMemoryCheckpointClient(
            namespace, rank="0", world_size=str(ctx.world_size), steps_retained=steps_retained
        )
        try:
            client.get_or_create_namespace()
        finally:
            client.close()
    dist.barrier()
    return seed_save_load(ctx, ports, namespace, steps, None)
