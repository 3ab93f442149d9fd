"""Rank functions for `tierckpt://` jobs: training code as a framework writes it.

Only torch, fsspec and the test's own state helpers are imported here: no tierckpt.
Each function first checks that nothing imported tierckpt, then uses stock DCP calls
with `tierckpt://` ids; fsspec finds the filesystem through the entry point. The daemon
comes from $TIERCKPT_DAEMON, set for the job by the test.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.support.dist_job import RankContext
from tests.support.jobs import _train_one_more_step, _wait_async, verify_loaded
from tests.support.state_dicts import assert_all_differ, build_state, load_expected, save_expected

__all__ = ["load_with_url", "save_load_retain", "save_with_url"]

_STEP = re.compile(r"step[-=]0*(\d+)$")


def _assert_no_tierckpt_import() -> None:
    loaded = sorted(m for m in sys.modules if m == "tierckpt" or m.startswith("tierckpt."))
    assert not loaded, f"the training code must not need tierckpt, but imported {loaded}"


def _save(state: dict[str, Any], url: str, mode: str, src: Any) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if mode == "sync":
        dcp.save(state, checkpoint_id=url)
        return
    kind = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
    response = dcp.async_save(state, checkpoint_id=url, async_checkpointer_type=kind[mode])
    # Training goes on between staging and upload; the staged values must be saved.
    _wait_async(response, mutate=lambda: _train_one_more_step(src))


def _load_and_check(ctx: RankContext, url: str, expected: dict[str, Any], seed: int) -> int:
    target = build_state(seed, ctx.rank, steps=1, lr=2e-3)
    assert_all_differ(target.state_dict, expected, what=f"rank {ctx.rank} target before {url}")
    dcp.load(target.state_dict, checkpoint_id=url)
    return verify_loaded(ctx, target, expected, f"load of {url}")


def _purge_stale(root: str, keep_latest_k: int) -> list[str]:
    """torchtitan's retention (`_purge_stale_checkpoints`): list the folder, parse steps,
    `rm(recursive=True)` all but the newest k. Returns what it removed."""
    import fsspec

    fs, _ = fsspec.url_to_fs(root)
    steps = sorted(
        (int(m.group(1)), name)
        for name in fs.ls(root, detail=False)
        if (m := _STEP.search(name.rsplit("/", 1)[-1]))
    )
    stale = [name for _, name in steps[: max(0, len(steps) - keep_latest_k)]]
    for name in stale:
        fs.rm(f"tierckpt://{name}", recursive=True)
    return [name.rsplit("/", 1)[-1] for name in stale]


def _find_load_step(root: str) -> int:
    """torchtitan's "latest step" discovery (`_find_load_step`): the highest step whose
    folder holds a `.metadata` file."""
    import fsspec

    fs, _ = fsspec.url_to_fs(root)
    found = [
        int(m.group(1))
        for name in fs.ls(root, detail=False)
        if (m := _STEP.search(name.rsplit("/", 1)[-1]))
        and fs.isfile(f"tierckpt://{name}/.metadata")
    ]
    return max(found, default=-1)


def save_load_retain(
    ctx: RankContext, namespace: str, expected_root: str, seed: int
) -> dict[str, Any]:
    """Save with dcp.save, async_save THREAD and PROCESS (a Lightning-style `=` id), load
    each bit-exact; then periodic saves with retention, discovery and `latest`."""
    _assert_no_tierckpt_import()
    root = f"tierckpt://{namespace}"
    saves = [("step-000100", "sync"), ("step-000200", "thread"), ("epoch=0-step=300", "process")]
    leaves = []
    for i, (cid, mode) in enumerate(saves):
        src = build_state(seed + i, ctx.rank)
        expected = save_expected(src.state_dict, f"{expected_root}/{cid}", ctx.rank)
        _save(src.state_dict, f"{root}/{cid}", mode, src)
        leaves.append(_load_and_check(ctx, f"{root}/{cid}", expected, seed + 500 + i))

    removed: list[list[str]] = []
    for i, step in enumerate((400, 500, 600)):
        src = build_state(seed + 10 + i, ctx.rank)
        expected = save_expected(src.state_dict, f"{expected_root}/step-{step:06d}", ctx.rank)
        dcp.save(src.state_dict, checkpoint_id=f"{root}/step-{step:06d}")
        if ctx.rank == 0:
            removed.append(_purge_stale(root, keep_latest_k=2))
        dist.barrier()
    leaves.append(_load_and_check(ctx, f"{root}/latest", expected, seed + 900))
    return {
        "leaves": leaves,
        "removed": removed,
        "load_step": _find_load_step(root),
    }


def load_with_url(
    ctx: RankContext, url: str, expected_dir: str, seed: int, *, training_code: bool = True
) -> dict[str, Any]:
    """Load `url` at this job's world size (one process without a process group: a plain
    model) into different state; bit-exact. `training_code`: check no tierckpt import."""
    if training_code:
        _assert_no_tierckpt_import()
    expected = load_expected(expected_dir, ctx.rank)
    return {"leaves": _load_and_check(ctx, url, expected, seed), "world": ctx.world_size}


def save_with_url(ctx: RankContext, url: str, expected_dir: str, seed: int) -> int:
    """One stock `dcp.save` to `url` at this job's world size, recording what each rank
    saved (the snapshot a load at another world size compares with)."""
    _assert_no_tierckpt_import()
    src = build_state(seed, ctx.rank)
    save_expected(src.state_dict, expected_dir, ctx.rank)
    dcp.save(src.state_dict, checkpoint_id=url)
    return ctx.world_size
