"""The rank side of bench/soak.py: a real gloo job that saves in a loop.

Imported by module name in the ranks torch's "spawn" starts (sys.path travels with
them), so it holds no state of the driver. Every value a rank saves is a function of
(save index, rank), so any kept checkpoint can be checked bit-exact without keeping it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _exact import blank_like, check_exact

from tests.support.backends import Nodes
from tests.support.dist_job import RankContext

__all__ = ["SoakPlan", "checkpoint_id", "soak_rank"]

TENSORS = 4
RESUME_TIMEOUT = 600.0


@dataclass(frozen=True)
class SoakPlan:
    """What every rank does; picklable into the spawned ranks."""

    namespace: str
    addresses: tuple[str, ...]
    saves: int
    rank_bytes: int
    keep_last: int
    sample_every: int
    load_every: int


def checkpoint_id(index: int) -> str:
    return f"step-{index:06d}"


def state_for(index: int, rank: int, rank_bytes: int) -> dict[str, Any]:
    """The state a rank saves at `index`: float32 tensors under rank-unique keys (each
    rank writes its own file), plus the step as a plain object (deduplicated to rank 0)."""
    gen = torch.Generator().manual_seed(index * 1009 + rank)
    per = max(1, rank_bytes // 4 // TENSORS)
    state: dict[str, Any] = {
        f"rank{rank}.t{j}": torch.randn(per + j, generator=gen) for j in range(TENSORS)
    }
    state["step"] = {"index": index}
    return state


def _load_and_check(plan: SoakPlan, backend: Nodes, rank: int, index: int, newest: bool) -> int:
    """Load checkpoint `index` (by id, or as the newest with checkpoint_id=None) into
    zeroed state with a new reader, and compare every byte with what was saved."""
    expected = state_for(index, rank, plan.rank_bytes)
    target = blank_like(expected)
    dcp.load(
        target,
        checkpoint_id=None if newest else checkpoint_id(index),
        storage_reader=backend.reader(),
    )
    what = f"rank {rank} load of {'newest' if newest else checkpoint_id(index)}"
    return check_exact(target, expected, what)


def _wait_resume(ctx: RankContext, index: int) -> None:
    """Hold here (every rank) while the driver samples the quiescent daemons."""
    path = Path(ctx.job_dir, f"resume-{index}")
    deadline = time.monotonic() + RESUME_TIMEOUT
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the soak driver never released sample point {index}")
        time.sleep(0.01)


def soak_rank(ctx: RankContext, plan: SoakPlan) -> dict[str, int]:
    """Save `plan.saves` checkpoints, each with a new TieredStorageWriter on this rank's
    node; every `load_every` saves load the newest (checkpoint_id=None) and the oldest
    one retention keeps, bit-exact; every `sample_every` saves stop for the driver."""
    backend = Nodes(plan.namespace, plan.addresses, ranks_per_node=1)
    loads = loaded_bytes = 0
    started = time.monotonic()
    for index in range(1, plan.saves + 1):
        state = state_for(index, ctx.rank, plan.rank_bytes)
        dcp.save(state, checkpoint_id=checkpoint_id(index), storage_writer=backend.writer())
        if index % plan.load_every == 0 or index == plan.saves:
            loaded_bytes += _load_and_check(plan, backend, ctx.rank, index, newest=True)
            oldest_kept = max(1, index - plan.keep_last + 1)
            loaded_bytes += _load_and_check(plan, backend, ctx.rank, oldest_kept, newest=False)
            loads += 2
        if index % plan.sample_every == 0 or index == plan.saves:
            dist.barrier()
            if ctx.rank == 0:
                ctx.marker(f"at-{index}")
            _wait_resume(ctx, index)
            dist.barrier()
    return {
        "saves": plan.saves,
        "loads": loads,
        "loaded_bytes": loaded_bytes,
        "seconds": int(time.monotonic() - started),
    }
