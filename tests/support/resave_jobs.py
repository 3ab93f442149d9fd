"""Rank functions of the re-save tests (tests/integration/test_resave.py): spawned ranks
import them by module path."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

from tests.support.backends import Nodes
from tests.support.dist_job import RankContext
from tests.support.fault_writer import StallingWriter
from tests.support.state_dicts import build_state, save_expected

__all__ = ["resave_and_stall"]


def resave_and_stall(
    ctx: RankContext, backend: Nodes, checkpoint_id: str, expected_root: str, seed: int
) -> None:
    """Re-save the committed `checkpoint_id` (other values, kept under `expected_root`)
    through this rank's node, and stall after writing every byte, before the commit,
    until the test kills the rank."""
    src = build_state(seed, ctx.rank)
    save_expected(src.state_dict, f"{expected_root}/{checkpoint_id}", ctx.rank)
    address = backend.addresses[ctx.rank // backend.ranks_per_node]
    writer = StallingWriter(backend.namespace, daemon=address)
    writer.configure_stall(ctx.job_dir, ctx.rank, hold_seconds=300.0)
    dcp.save(src.state_dict, checkpoint_id=checkpoint_id, storage_writer=writer)
    raise AssertionError("the stalled re-save returned; the test should have killed this rank")
