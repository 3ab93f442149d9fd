"""The rank side of bench/chaos.py: a real gloo job that saves in a loop while the
driver breaks things around it.

Imported by module name in the ranks torch's "spawn" starts (sys.path travels with
them). Every value saved is a function of (save index, rank), so the driver checks any
listed checkpoint bit-exact without keeping a copy (`expected_state`). A failed save is
what a training job sees when its node dies: it is recorded and the loop goes on with
the next index, as a job that checkpoints again at its next step would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _exact import blank_like, check_exact

from tests.support.backends import Nodes
from tests.support.dist_job import RankContext

__all__ = [
    "ChaosPlan",
    "chaos_rank",
    "checkpoint_id",
    "expected_state",
    "index_of",
    "verifier_main",
]

TENSORS = 3


@dataclass(frozen=True)
class ChaosPlan:
    """What every rank does; picklable into the spawned ranks."""

    namespace: str
    addresses: tuple[str, ...]
    rank_bytes: int
    pause: float  # seconds of "training" between saves


def checkpoint_id(index: int) -> str:
    return f"step-{index:08d}"


def index_of(checkpoint: str) -> int:
    return int(checkpoint.rsplit("-", 1)[1])


def rank_state(index: int, rank: int, rank_bytes: int) -> dict[str, Any]:
    """Rank-unique float32 tensors (each rank writes its own file) and the step."""
    gen = torch.Generator().manual_seed(index * 7919 + rank)
    per = max(1, rank_bytes // 4 // TENSORS)
    state: dict[str, Any] = {
        f"rank{rank}.t{j}": torch.randn(per + j, generator=gen) for j in range(TENSORS)
    }
    state["step"] = {"index": index}
    return state


def expected_state(index: int, world: int, rank_bytes: int) -> dict[str, Any]:
    """Everything the job saved at `index`, as one process loads it (resharded)."""
    merged: dict[str, Any] = {}
    for rank in range(world):
        merged.update(rank_state(index, rank, rank_bytes))
    return merged


def verifier_main(conn: Any, namespace: str, world: int, rank_bytes: int) -> None:
    """The driver's loader, in a process of its own (a stuck load is killed, not waited
    on): for each (checkpoint_id, where) received, load it into zeroed state with a new
    TieredStorageReader (where: a daemon address) or with stock DCP (where: the URL of
    its directory in the persistent tier), and compare every byte with what was saved;
    answers ("ok", bytes) or ("fail", error)."""
    import logging
    import warnings

    from tierckpt import TieredStorageReader

    torch.set_num_threads(1)
    logging.disable(logging.CRITICAL)  # DCP logs each failed read with its traceback
    warnings.simplefilter("ignore")
    while True:
        task = conn.recv()
        if task is None:
            return
        checkpoint, where = task
        try:
            expected = expected_state(index_of(checkpoint), world, rank_bytes)
            target = blank_like(expected)
            if "://" in where and not where.startswith("unix:"):
                dcp.load(target, checkpoint_id=where)  # stock DCP, fsspec URL
            else:
                reader = TieredStorageReader(namespace, daemon=where)
                dcp.load(target, checkpoint_id=checkpoint, storage_reader=reader)
            checked = check_exact(target, expected, checkpoint)
            conn.send(("ok", checked))
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            conn.send(("fail", f"{type(e).__name__}: {e}"[:3000]))


def chaos_rank(ctx: RankContext, plan: ChaosPlan, first: int) -> None:
    """Save indexes `first`, `first + 1`, ... until the driver's stop file appears; each
    outcome is a file `<ok|fail>.<index>.rank<r>` in the job dir (fail: the error)."""
    backend = Nodes(plan.namespace, plan.addresses, ranks_per_node=1)
    stop = Path(ctx.job_dir, "stop")
    index = first
    while not stop.exists():
        state = rank_state(index, ctx.rank, plan.rank_bytes)
        outcome, text = "ok", ""
        try:
            dcp.save(state, checkpoint_id=checkpoint_id(index), storage_writer=backend.writer())
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            outcome, text = "fail", f"{type(e).__name__}: {e}"[:2000]
        Path(ctx.job_dir, f"{outcome}.{index}.rank{ctx.rank}").write_text(text)
        index += 1
        time.sleep(plan.pause)
