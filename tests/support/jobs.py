"""Rank functions run by the integration tests through `dist_job.run_job`.

They live here, not in the test modules, because spawned ranks import them by module
name. Each one checks bit-exactness itself and returns a small summary.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tests.support.backends import Backend
from tests.support.dist_job import RankContext
from tests.support.state_dicts import (
    apply_and_reread,
    assert_all_differ,
    assert_state_equal,
    build_state,
    load_expected,
    save_expected,
    snapshot,
)

__all__ = [
    "load_and_verify",
    "save_and_load",
    "save_only",
    "save_then_hang_in_second_save",
]

TARGET_SEED_OFFSET = 1000


def _wait_async(response: Any, *, mutate: Any = None, timeout: float = 90.0) -> None:
    """Wait for an async_save; between staging and upload, run `mutate` (training goes on)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    if isinstance(response, AsyncSaveResponse):
        response.staging_completion.result(timeout=timeout)
        if mutate is not None:
            mutate()
        response.upload_completion.result(timeout=timeout)
    else:
        if mutate is not None:
            mutate()
        response.result(timeout=timeout)


def _train_one_more_step(train: Any) -> None:
    """Change every parameter and optimizer state tensor in place, as the next step would.

    Local ops only: in THREAD mode the save runs collectives on the same gloo group from
    another thread, so the test must not issue collectives concurrently.
    """
    with torch.no_grad():
        for p in train.model.parameters():
            p.add_(1.0)
        for state in train.optim.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.add_(1.0)


def verify_loaded(ctx: RankContext, train: Any, expected: dict[str, Any], label: str) -> int:
    """Compare the loaded state dict and, after applying it, the model and optimizer."""
    leaves = assert_state_equal(
        actual=train.state_dict, expected=expected, what=f"rank {ctx.rank} {label} (state dict)"
    )
    reread = apply_and_reread(train)
    assert_state_equal(
        actual=reread,
        expected=expected,
        what=f"rank {ctx.rank} {label} (model/optim after set_state_dict)",
    )
    return leaves


def save_and_load(
    ctx: RankContext,
    backend: Backend,
    checkpoint_id: str,
    expected_dir: str,
    seed: int,
    mode: str = "sync",
) -> dict[str, Any]:
    """Save the state for `seed`, then load it into different state in the same job."""
    src = build_state(seed, ctx.rank)
    expected = save_expected(src.state_dict, expected_dir, ctx.rank)
    if mode == "sync":
        backend.save(src.state_dict, checkpoint_id)
    else:
        response = backend.async_save(src.state_dict, checkpoint_id, mode)
        # The staged copy must be what is saved, not the state after the next step.
        _wait_async(response, mutate=lambda: _train_one_more_step(src))
        assert_all_differ(
            {"model": src.state_dict["model"]},
            expected,
            what=f"rank {ctx.rank} mutation after staging",
        )
    target = build_state(seed + TARGET_SEED_OFFSET, ctx.rank, steps=1, lr=2e-3)
    assert_all_differ(target.state_dict, expected, what=f"rank {ctx.rank} target before load")
    backend.load(target.state_dict, checkpoint_id)
    leaves = verify_loaded(ctx, target, expected, f"load of {checkpoint_id}")
    return {"leaves": leaves}


def save_only(
    ctx: RankContext,
    backend: Backend,
    checkpoint_ids: list[str],
    expected_root: str,
    seed: int,
) -> list[str]:
    """Save one checkpoint per id, each with different values (seed + index), recording each."""
    for i, checkpoint_id in enumerate(checkpoint_ids):
        src = build_state(seed + i, ctx.rank)
        save_expected(src.state_dict, f"{expected_root}/{checkpoint_id}", ctx.rank)
        backend.save(src.state_dict, checkpoint_id)
    return checkpoint_ids


def load_and_verify(
    ctx: RankContext,
    backend: Backend,
    checkpoint_id: str | None,
    expected_dir: str,
) -> dict[str, Any]:
    """Load `checkpoint_id` (None: newest) into fresh different state and compare with the snapshot."""
    expected = load_expected(expected_dir, ctx.rank)
    target = build_state(77_000 + ctx.rank, ctx.rank, steps=1, lr=2e-3)
    assert_all_differ(target.state_dict, expected, what=f"rank {ctx.rank} target before load")
    backend.load(target.state_dict, checkpoint_id)
    leaves = verify_loaded(ctx, target, expected, f"load of {checkpoint_id or 'newest'}")
    return {"leaves": leaves, "world": ctx.world_size}


def load_plain_no_pg(
    ctx: RankContext,
    backend: Backend,
    checkpoint_id: str | None,
    expected_dir: str,
) -> dict[str, Any]:
    """One process, no process group: load a sharded checkpoint into a plain model's state."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    expected = load_expected(expected_dir, 0)
    target = build_state(88_000, 0, steps=1, lr=2e-3, fsdp=False)
    assert_all_differ(target.state_dict, expected, what="no-PG target before load")
    backend.load(target.state_dict, checkpoint_id)
    leaves = verify_loaded(ctx, target, expected, f"no-PG load of {checkpoint_id}")
    return {"leaves": leaves}


def save_then_hang_in_second_save(
    ctx: RankContext,
    namespace: str,
    address: str,
    first_id: str,
    second_id: str,
    expected_root: str,
    seed: int,
    stall: str = "before_commit",
) -> None:
    """Commit `first_id`, then start `second_id` and stall until killed.

    `stall`: "before_commit" (after write_data finished, before finish) or "mid_write"
    (inside the byte copy of the rank's data, through a stalling planner).
    """
    import torch.distributed.checkpoint as dcp

    from tests.support.backends import Tiered
    from tests.support.fault_writer import StallingPlanner, StallingWriter

    backend = Tiered(namespace, address)
    src = build_state(seed, ctx.rank)
    save_expected(src.state_dict, f"{expected_root}/{first_id}", ctx.rank)
    backend.save(src.state_dict, first_id)
    ctx.marker("first_saved")
    _train_one_more_step(src)
    if stall == "before_commit":
        writer = StallingWriter(namespace, daemon=address)
        writer.configure_stall(ctx.job_dir, ctx.rank, hold_seconds=300.0)
        dcp.save(src.state_dict, checkpoint_id=second_id, storage_writer=writer)
    elif stall == "mid_write":
        planner = StallingPlanner(ctx.job_dir, ctx.rank)
        dcp.save(
            src.state_dict,
            checkpoint_id=second_id,
            storage_writer=backend.writer(),
            planner=planner,
        )
    else:
        raise ValueError(stall)
    raise AssertionError("the stalled save returned; the test should have killed this rank")


def snapshot_only(ctx: RankContext, seed: int) -> dict[str, Any]:
    """The full state for `seed` (for comparisons in the test process)."""
    return snapshot(build_state(seed, ctx.rank).state_dict)


def sleep_forever(ctx: RankContext) -> None:
    time.sleep(3600)


def run_steps(ctx: RankContext, backend: Backend, steps: list[tuple[Any, ...]]) -> list[Any]:
    """Run a script of checkpoint steps in one job (spawning ranks is the slow part).

    Steps:
        ("save", checkpoint_id, expected_dir, seed): save the state for `seed`, snapshotting it.
        ("load", checkpoint_id | None, expected_dir): load into different state; bit-exact.
        ("save_fails", checkpoint_id, seed, error_class_name, pattern): the save must raise,
            on this rank, a `tierckpt.errors.<error_class_name>` (raw or inside
            CheckpointException) whose message matches `pattern`.
    """
    import tierckpt.errors

    from tests.support.errors import assert_error, capture, describe

    results: list[Any] = []
    for step in steps:
        kind = step[0]
        if kind == "save":
            _, checkpoint_id, expected_dir, seed = step
            src = build_state(seed, ctx.rank)
            save_expected(src.state_dict, expected_dir, ctx.rank)
            backend.save(src.state_dict, checkpoint_id)
            results.append(checkpoint_id)
        elif kind == "load":
            _, checkpoint_id, expected_dir = step
            results.append(load_and_verify(ctx, backend, checkpoint_id, expected_dir))
        elif kind == "save_fails":
            _, checkpoint_id, seed, class_name, pattern = step
            src = build_state(seed, ctx.rank)
            exc = capture(lambda s=src, c=checkpoint_id: backend.save(s.state_dict, c), within=60)
            assert_error(exc, getattr(tierckpt.errors, class_name), pattern)
            results.append(describe(exc))
        else:
            raise ValueError(f"unknown step {step!r}")
    return results
