"""Rank functions of the per-tier completion tests (spawned ranks import them by module
name): each rank saves asynchronously and waits, through `tierckpt.wait_for`, for the
tier asked, as a training loop would before advancing "latest"."""

from __future__ import annotations

import time
from typing import Any

from tests.support.backends import Nodes
from tests.support.dist_job import RankContext
from tests.support.state_dicts import build_state, save_expected

__all__ = ["async_save_and_wait"]


def async_save_and_wait(
    ctx: RankContext,
    backend: Nodes,
    checkpoint_id: str,
    expected_root: str,
    seed: int,
    executor: str,
    tier: str,
    copies: int,
) -> dict[str, Any]:
    """async_save with a TieredStorageWriter on this rank's node, then wait on the returned
    future for `tier`; the levels this rank's daemon answered and how long it took."""
    import tierckpt

    src = build_state(seed, ctx.rank)
    save_expected(src.state_dict, f"{expected_root}/{checkpoint_id}", ctx.rank)
    started = time.monotonic()
    response = backend.async_save(src.state_dict, checkpoint_id, executor)
    state = tierckpt.wait_for(response, tier, copies=copies, timeout=120)
    return {
        "levels": state.levels(),
        "checkpoint_id": state.checkpoint_id,
        "seconds": time.monotonic() - started,
    }
