"""GPU figures: a CUDA state dict through `dcp.save`, `dcp.async_save` and `dcp.load`.

Runs where a CUDA device exists (skips with a message elsewhere). One rank, one daemon on
tmpfs. For each route it prints the wall time and the ratio to the same run's baselines:
the device->host copy into pinned memory (the floor of any save of GPU state), and stock
`FileSystemWriter`/`FileSystemReader` on the same tmpfs. Every load is checked bit-exact
against the state that was saved, on the GPU.

    python bench/bench_gpu.py [--gib 2] [--repeat 3] [--out results/gpu.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import GiB, daemon, machine_facts, tmpfs_root  # noqa: E402


def make_state(nbytes: int, tensor_bytes: int = 64 << 20) -> dict[str, torch.Tensor]:
    n = max(1, nbytes // tensor_bytes)
    gen = torch.Generator(device="cuda").manual_seed(7)
    return {
        f"layer{i}.w": torch.randn(tensor_bytes // 4, device="cuda", generator=gen)
        for i in range(n)
    }


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def check_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key, value in a.items():
        if b[key].device.type != "cuda" or not torch.equal(value, b[key]):
            raise AssertionError(f"restore is not bit-exact on the GPU: {key}")


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def best(values: list[float]) -> float:
    return min(values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured")
        return
    import torch.distributed.checkpoint as dcp
    from tierckpt import TieredStorageReader, TieredStorageWriter

    nbytes = int(args.gib * GiB)
    state = make_state(nbytes)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    figures: dict[str, Any] = {"bytes": nbytes, "machine": machine_facts()}
    figures["device"] = torch.cuda.get_device_name()

    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}

    def d2h() -> None:
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=True)

    figures["d2h_pinned_s"] = best([timed(d2h) for _ in range(args.repeat)])

    stock_root = tempfile.mkdtemp(prefix="stock-gpu-", dir=tmpfs_root())
    try:
        stock_saves = []
        for i in range(args.repeat):
            path = Path(stock_root) / f"s{i}"
            stock_saves.append(
                timed(
                    lambda p=path: dcp.save(
                        state, storage_writer=dcp.FileSystemWriter(str(p), sync_files=False)
                    )
                )
            )
        stock_loads = []
        for i in range(args.repeat):
            target = zeros_like(state)
            path = Path(stock_root) / f"s{i}"
            stock_loads.append(
                timed(
                    lambda p=path, t=target: dcp.load(
                        t, storage_reader=dcp.FileSystemReader(str(p))
                    )
                )
            )
            check_equal(state, target)
        stock_async = []
        for i in range(args.repeat):
            path = Path(stock_root) / f"a{i}"
            holder: list[Any] = []
            stock_async.append(
                timed(
                    lambda p=path, h=holder: h.append(
                        dcp.async_save(
                            state,
                            storage_writer=dcp.FileSystemWriter(str(p), sync_files=False),
                        )
                    )
                )
            )
            holder[0].result()
        figures["stock"] = {
            "save_s": stock_saves,
            "load_s": stock_loads,
            "async_block_s": stock_async,
        }
    finally:
        shutil.rmtree(stock_root, ignore_errors=True)

    with daemon(budget=f"{max(8, int(4 * nbytes / GiB) + 2)}GiB", keep_last=2) as d:
        ns = "gpu-bench"
        saves, loads, blocks = [], [], []
        for i in range(args.repeat):
            cid = f"sync-{i}"
            saves.append(
                timed(
                    lambda c=cid: dcp.save(
                        state,
                        checkpoint_id=c,
                        storage_writer=TieredStorageWriter(ns, daemon=d.address),
                    )
                )
            )
            target = zeros_like(state)
            loads.append(
                timed(
                    lambda c=cid, t=target: dcp.load(
                        t,
                        checkpoint_id=c,
                        storage_reader=TieredStorageReader(ns, daemon=d.address),
                    )
                )
            )
            check_equal(state, target)
        for i in range(args.repeat):
            cid = f"async-{i}"
            holder2: list[Any] = []
            blocks.append(
                timed(
                    lambda c=cid, h=holder2: h.append(
                        dcp.async_save(
                            state,
                            checkpoint_id=c,
                            storage_writer=TieredStorageWriter(ns, daemon=d.address),
                        )
                    )
                )
            )
            holder2[0].result()
            target = zeros_like(state)
            dcp.load(
                target,
                checkpoint_id=cid,
                storage_reader=TieredStorageReader(ns, daemon=d.address),
            )
            check_equal(state, target)
        figures["tierckpt"] = {"save_s": saves, "load_s": loads, "async_block_s": blocks}

    stock, tier = figures["stock"], figures["tierckpt"]
    floor = figures["d2h_pinned_s"]
    gb = nbytes / 1e9
    print(f"GPU: {figures['device']}, state {gb:.2f} GB, best of {args.repeat}")
    print(f"  device->pinned host copy (floor): {floor:.3f} s ({gb / floor:.1f} GB/s)")
    rows = [
        ("save", "save_s"),
        ("load (bit-exact)", "load_s"),
        ("async_save blocking", "async_block_s"),
    ]
    for label, key in rows:
        t, s = best(tier[key]), best(stock[key])
        print(
            f"  {label:22s} tierckpt {t:.3f} s  stock {s:.3f} s  "
            f"tierckpt/stock {t / s:.2f}x  tierckpt/floor {t / floor:.2f}x  "
            f"(first call {tier[key][0]:.3f} s, stock {stock[key][0]:.3f} s)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
