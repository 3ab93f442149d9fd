"""Memory-tier benchmark: save, async_save and load through tierckptd, next to baselines
measured in the same run on the same bytes (the machine is shared and noisy: read ratios).

Scenarios: 1 GiB of tensors on one rank, and 2 x 512 MiB on two gloo ranks.
Baselines: memcpy, raw write into a fresh tmpfs file, torch.save into BytesIO per
tensor, stock FileSystemWriter to local disk and to tmpfs, FileSystemReader from tmpfs.

    python bench/bench_memory_tier.py [--gib 1.0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import GiB, MiB, Table, best_of, daemon, tmpfs_root  # noqa: E402
from tierckpt import TieredStorageReader, TieredStorageWriter  # noqa: E402

TENSOR_BYTES = 64 * MiB


def make_state(rank: int, nbytes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234 + rank)
    count = max(1, nbytes // TENSOR_BYTES)
    state: dict[str, Any] = {
        f"rank{rank}.w{i}": torch.randn(TENSOR_BYTES // 4, generator=g) for i in range(count)
    }
    state[f"rank{rank}.meta"] = {"step": 100, "rank": rank}
    return state


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {} for k, v in state.items()}


def check_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor) and not torch.equal(v, b[k]):
            raise AssertionError(f"bench restore is not bit-exact at {k}")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(fn: Any, repeat: int, setup: Any = None) -> float:
    """Wall time of the slowest rank for the fastest of `repeat` runs."""

    def run() -> None:
        barrier()
        fn()
        barrier()

    return best_of(run, repeat, setup)


def fresh_dir(base: str) -> str:
    return tempfile.mkdtemp(prefix="fsw-", dir=base)


def suite(
    rank: int, nbytes: int, repeat: int, address: str, scratch_disk: str, scratch_tmpfs: str
) -> Table:
    state = make_state(rank, nbytes)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    world = dist.get_world_size() if dist.is_initialized() else 1
    table = Table(f"{world} rank(s) x {nbytes / GiB:.2f} GiB", nbytes * world)

    # --- baselines ----------------------------------------------------------------------
    dst = [torch.empty_like(t) for t in tensors]
    for d, t in zip(dst, tensors, strict=True):  # touch the pages once: memcpy is a warm copy
        d.copy_(t)

    def memcpy() -> None:
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)

    table.add("memcpy (warm destination)", timed(memcpy, repeat))
    dst.clear()

    raw_path = os.path.join(scratch_tmpfs, f"raw-{rank}")

    def raw_write() -> None:
        with open(raw_path, "wb", buffering=0) as f:
            for t in tensors:
                f.write(memoryview(t.numpy()).cast("B"))

    table.add(
        "raw write into a fresh tmpfs file",
        timed(raw_write, repeat, setup=lambda: _unlink(raw_path)),
    )
    _unlink(raw_path)

    def torch_save_bytesio() -> None:
        for t in tensors:
            torch.save(t, io.BytesIO())

    table.add("torch.save into BytesIO per tensor", timed(torch_save_bytesio, repeat))

    def fsw(base: str) -> tuple[float, str]:
        paths: list[str] = []

        def setup() -> None:
            paths.append(_shared_dir(base))

        def run() -> None:
            dcp.save(state, storage_writer=FileSystemWriter(paths[-1]))

        seconds = timed(run, repeat, setup)
        for p in paths[:-1]:
            _rmtree_once(p)
        return seconds, paths[-1]

    disk_s, disk_path = fsw(scratch_disk)
    table.add("FileSystemWriter -> local disk (stock defaults)", disk_s)
    _rmtree_once(disk_path)
    tmpfs_s, tmpfs_path = fsw(scratch_tmpfs)
    table.add("FileSystemWriter -> tmpfs (stock defaults)", tmpfs_s)

    target = zeros_like_state(state)
    table.add(
        "FileSystemReader <- tmpfs",
        timed(lambda: dcp.load(target, storage_reader=FileSystemReader(tmpfs_path)), repeat),
    )
    check_equal(state, target)
    _rmtree_once(tmpfs_path)

    # --- tierckpt -----------------------------------------------------------------------
    ns = f"bench-{world}"
    counter = iter(range(1_000_000))

    def save() -> None:
        dcp.save(
            state,
            checkpoint_id=f"step-{next(counter):06d}",
            storage_writer=TieredStorageWriter(ns, daemon=address),
        )

    table.add("tierckpt dcp.save, first (cold tmpfs pages)", timed(save, 1))
    table.add("tierckpt dcp.save, steady state (recycled pages)", timed(save, repeat + 1))

    writer = TieredStorageWriter(ns, daemon=address)
    blocking: list[float] = []

    def async_save() -> None:
        barrier()
        start = time.perf_counter()
        fut = dcp.async_save(
            state, checkpoint_id=f"step-{next(counter):06d}", storage_writer=writer
        )
        blocking.append(time.perf_counter() - start)
        fut.result()

    total = timed(async_save, repeat + 1)
    table.add(
        "tierckpt dcp.async_save, blocking part", min(blocking[1:]), "training waits only for this"
    )
    table.add("tierckpt dcp.async_save, until durable in memory", total)

    target = zeros_like_state(state)
    table.add(
        "tierckpt dcp.load (newest, verified)",
        timed(
            lambda: dcp.load(target, storage_reader=TieredStorageReader(ns, daemon=address)), repeat
        ),
    )
    check_equal(state, target)
    return table


def _unlink(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def _shared_dir(base: str) -> str:
    """A fresh directory that every rank agrees on."""
    box = [fresh_dir(base) if not dist.is_initialized() or dist.get_rank() == 0 else ""]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _rmtree_once(path: str) -> None:
    barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    barrier()


RATIOS = [
    (
        "sync save vs FileSystemWriter -> tmpfs",
        "tierckpt dcp.save, steady state (recycled pages)",
        "FileSystemWriter -> tmpfs (stock defaults)",
    ),
    (
        "sync save vs FileSystemWriter -> local disk",
        "tierckpt dcp.save, steady state (recycled pages)",
        "FileSystemWriter -> local disk (stock defaults)",
    ),
    (
        "first sync save (cold pages) vs FileSystemWriter -> tmpfs",
        "tierckpt dcp.save, first (cold tmpfs pages)",
        "FileSystemWriter -> tmpfs (stock defaults)",
    ),
    (
        "sync save vs memcpy (1.0 = one copy at memcpy speed)",
        "tierckpt dcp.save, steady state (recycled pages)",
        "memcpy (warm destination)",
    ),
    (
        "async_save blocking vs FileSystemWriter -> tmpfs",
        "tierckpt dcp.async_save, blocking part",
        "FileSystemWriter -> tmpfs (stock defaults)",
    ),
    (
        "load vs FileSystemReader <- tmpfs",
        "tierckpt dcp.load (newest, verified)",
        "FileSystemReader <- tmpfs",
    ),
    (
        "load vs memcpy (goal >= 0.8)",
        "tierckpt dcp.load (newest, verified)",
        "memcpy (warm destination)",
    ),
    (
        "save vs torch.save into BytesIO (the path we replace)",
        "tierckpt dcp.save, steady state (recycled pages)",
        "torch.save into BytesIO per tensor",
    ),
]


def _rank_main(
    rank: int,
    world: int,
    store_dir: str,
    nbytes: int,
    repeat: int,
    address: str,
    disk: str,
    shm: str,
    out: str,
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world
    )
    try:
        table = suite(rank, nbytes, repeat, address, disk, shm)
        if rank == 0:
            Path(out).write_text(
                json.dumps({"title": table.title, "nbytes": table.nbytes, "rows": table.rows})
            )
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--gib",
        type=float,
        default=1.0,
        help="GiB of tensors in the 1-rank case (2-rank: half each)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--tmpfs",
        help="tmpfs directory for the memory tier and the tmpfs baselines (default /dev/shm); "
        "e.g. a mount with huge=within_size",
    )
    args = parser.parse_args()
    if args.tmpfs:
        os.environ["TIERCKPT_BENCH_TMPFS"] = args.tmpfs  # inherited by the spawned ranks
    print(f"tmpfs for the memory tier and baselines: {tmpfs_root()}", flush=True)
    nbytes = int(args.gib * GiB)
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    disk = tempfile.mkdtemp(prefix="tierckpt-bench-disk-")
    shm = tempfile.mkdtemp(prefix="tierckpt-bench-fsw-", dir=tmpfs_root())
    results: list[dict[str, Any]] = []
    try:
        with daemon(budget="16GiB", keep_last=1) as d:
            single = suite(0, nbytes, args.repeat, d.address, disk, shm)
            print(single.render(RATIOS), flush=True)
            results.append({"title": single.title, "nbytes": single.nbytes, "rows": single.rows})
        with daemon(budget="16GiB", keep_last=1) as d, tempfile.TemporaryDirectory() as store:
            out = os.path.join(store, "result.json")
            mp.start_processes(
                _rank_main,
                args=(2, store, nbytes // 2, args.repeat, d.address, disk, shm, out),
                nprocs=2,
                start_method="spawn",
            )
            data = json.loads(Path(out).read_text())
            multi = Table(data["title"], data["nbytes"], [tuple(r) for r in data["rows"]])
            print(multi.render(RATIOS), flush=True)
            results.append(data)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "memory_tier.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
