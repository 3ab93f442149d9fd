"""Routes bench: native `TieredStorageWriter`/`Reader` vs `tierckpt://` URLs vs stock DCP.

Why: issue 11 keeps the native writer/reader as the fast path and adds `tierckpt://` for
frameworks that only pass DCP a `checkpoint_id` string; a user choosing between them needs
both figures side by side, next to stock `FileSystemWriter`/`Reader` into tmpfs and a
memcpy of the same bytes, all measured in the same run (the machine is shared: read the
ratios, not the seconds).

One rank, `--gib` of fp32 tensors in 16 tensors (1 GiB = 16 x 64 MiB), ONE tierckptd with
the default configuration (only its socket and memory directory are set). Per route, sync
saves one by one: save #1 is a first save (fresh pages), the steady state is the fastest of
the saves after the first 3; before each save the previous checkpoint is deleted (untimed:
`DaemonClient.delete_checkpoint` for native, `fs.rm(recursive=True)` for `tierckpt://`, a
directory removal for stock), so the daemon's pool recycles its pages. Every load goes into
pre-touched tensors and is checked bit-exact (the check is not timed). A tiny untimed save
and load per route first keeps one-off setup off whichever route runs first.

- native: `dcp.save(storage_writer=TieredStorageWriter(ns))`, a new writer per save;
  `dcp.load(storage_reader=TieredStorageReader(ns))`;
- `tierckpt://`: stock `dcp.save`/`dcp.load` with `checkpoint_id="tierckpt://ns/id"`;
  `$TIERCKPT_DAEMON` names the daemon and the `fsspec.specs` entry point finds the protocol;
- stock: `FileSystemWriter` into a fresh tmpfs directory per save, `FileSystemReader`.

    python bench/bench_routes.py [--quick] [--gib 1.0] [--repeat 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import GiB, MiB, daemon, machine_facts, tmpfs_root  # noqa: E402
from tierckpt import TieredStorageReader, TieredStorageWriter  # noqa: E402
from tierckpt.daemon_client import DaemonClient  # noqa: E402

TENSORS = 16
WARMUP_SAVES = 3  # the steady state is measured after this many saves
ROUTES = ("native", "tierckpt://", "stock")
RESULTS = Path(__file__).resolve().parent / "results" / "routes.json"


def make_state(nbytes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    each = max(4, nbytes // TENSORS // 4 * 4)
    state: dict[str, Any] = {f"w{i}": torch.randn(each // 4, generator=g) for i in range(TENSORS)}
    state["meta"] = {"step": 100}
    return state


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {} for k, v in state.items()}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memcpy_s(state: dict[str, Any], repeat: int) -> list[float]:
    """torch `copy_` into pre-touched tensors of the same bytes (all cores)."""
    src = tensors_of(state)
    dst = [torch.empty_like(t) for t in src]

    def copy() -> None:
        for d, t in zip(dst, src, strict=True):
            d.copy_(t)

    copy()  # touch the destination once: a warm copy, as the pool's recycled pages are
    return [timed(copy) for _ in range(repeat + 1)]


class Route:
    """How one route saves, loads and deletes checkpoint `step` (ids are step-NNNNNN)."""

    def save(self, state: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def load(self, target: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def delete(self, step: int) -> None:
        raise NotImplementedError


class Native(Route):
    def __init__(self, address: str, namespace: str) -> None:
        self.address, self.namespace = address, namespace
        self.client = DaemonClient(address)

    def save(self, state: dict[str, Any], step: int) -> None:
        writer = TieredStorageWriter(self.namespace, daemon=self.address)  # new per save
        dcp.save(state, checkpoint_id=f"step-{step:06d}", storage_writer=writer)

    def load(self, target: dict[str, Any], step: int) -> None:
        reader = TieredStorageReader(self.namespace, daemon=self.address)
        dcp.load(target, checkpoint_id=f"step-{step:06d}", storage_reader=reader)

    def delete(self, step: int) -> None:
        self.client.delete_checkpoint(self.namespace, f"step-{step:06d}")


class Url(Route):
    """Stock DCP calls only; the daemon comes from $TIERCKPT_DAEMON (set by main)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.fs = fsspec.filesystem("tierckpt")

    def url(self, step: int) -> str:
        return f"tierckpt://{self.namespace}/step-{step:06d}"

    def save(self, state: dict[str, Any], step: int) -> None:
        dcp.save(state, checkpoint_id=self.url(step))

    def load(self, target: dict[str, Any], step: int) -> None:
        dcp.load(target, checkpoint_id=self.url(step))

    def delete(self, step: int) -> None:
        self.fs.rm(self.url(step), recursive=True)


class Stock(Route):
    """`FileSystemWriter` into a new tmpfs directory per save (a first save, every time)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.dirs: dict[int, str] = {}

    def save(self, state: dict[str, Any], step: int) -> None:
        path = self.dirs[step] = tempfile.mkdtemp(prefix=f"step-{step:06d}-", dir=self.root)
        dcp.save(state, storage_writer=FileSystemWriter(path))

    def load(self, target: dict[str, Any], step: int) -> None:
        dcp.load(target, storage_reader=FileSystemReader(self.dirs[step]))

    def delete(self, step: int) -> None:
        shutil.rmtree(self.dirs.pop(step), ignore_errors=True)


def measure(route: Route, state: dict[str, Any], repeat: int) -> dict[str, Any]:
    """Saves #1..#(3+repeat), the previous one deleted before each; then `repeat` loads."""
    saves = []
    last = WARMUP_SAVES + repeat
    for step in range(1, last + 1):
        if step > 1:
            route.delete(step - 1)  # untimed: lets the pool recycle the pages
        start = time.perf_counter()
        route.save(state, step)
        saves.append(time.perf_counter() - start)
    target = zeros_like_state(state)
    loads = []
    for _ in range(repeat):
        for t in tensors_of(target):
            t.zero_()
        loads.append(timed(lambda: route.load(target, last)))
        for k, v in state.items():  # bit-exact, every load
            if isinstance(v, torch.Tensor) and not torch.equal(v, target[k]):
                raise AssertionError(f"{type(route).__name__} load is not bit-exact at {k}")
    route.delete(last)
    return {
        "save_s": saves,
        "first_save_s": saves[0],
        "steady_save_s": min(saves[WARMUP_SAVES:]),
        "load_s": loads,
        "best_load_s": min(loads),
    }


def warm_up(address: str, stock_root: str) -> None:
    """One tiny save and load per route, untimed: the first DCP call in a process pays for
    imports and first-call setup, which must not land on whichever route is measured first."""
    tiny = make_state(TENSORS * 4096)
    warm_routes: list[Route] = [
        Stock(stock_root),
        Native(address, "routes-warm-up-native"),
        Url("routes-warm-up-url"),
    ]
    for route in warm_routes:
        route.save(tiny, 1)
        route.load(zeros_like_state(tiny), 1)
        route.delete(1)


def ratios(figures: dict[str, dict[str, Any]], memcpy: float) -> dict[str, dict[str, float]]:
    stock = figures["stock"]
    out = {}
    for name, f in figures.items():
        out[name] = {
            "first_save_stock_over_route": stock["first_save_s"] / f["first_save_s"],
            "steady_save_stock_over_route": stock["steady_save_s"] / f["steady_save_s"],
            "load_stock_over_route": stock["best_load_s"] / f["best_load_s"],
            "steady_save_memcpy_over_route": memcpy / f["steady_save_s"],
            "load_memcpy_over_route": memcpy / f["best_load_s"],
        }
    return out


def render(record: dict[str, Any]) -> str:
    nbytes, memcpy = record["nbytes"], record["memcpy_best_s"]
    out = [
        f"\n## Routes, sync, 1 rank, {nbytes / GiB:.3f} GiB in {TENSORS} tensors"
        f" (load average {record['loadavg_before'][0]:.2f} before,"
        f" {record['loadavg_after'][0]:.2f} after)",
        f"memcpy (best of {len(record['memcpy_s'])}): {memcpy:.3f} s"
        f" ({nbytes / memcpy / 1e9:.2f} GB/s)",
        f"{'route':<12} {'save #1 s':>9} {'steady s':>9} {'load s':>8}   "
        f"{'stock/route: #1 steady load':<30} {'memcpy/route: steady load'}",
    ]
    for name in ROUTES:
        f, r = record["routes"][name], record["ratios"][name]
        out.append(
            f"{name:<12} {f['first_save_s']:>9.3f} {f['steady_save_s']:>9.3f}"
            f" {f['best_load_s']:>8.3f}   "
            f"{r['first_save_stock_over_route']:>8.2f}x"
            f" {r['steady_save_stock_over_route']:>6.2f}x"
            f" {r['load_stock_over_route']:>6.2f}x          "
            f"{r['steady_save_memcpy_over_route']:>6.2f}x"
            f" {r['load_memcpy_over_route']:>6.2f}x"
        )
    n, u = record["ratios"]["native"], record["ratios"]["tierckpt://"]
    out.append(
        "tierckpt:// time / native time:"
        f" save #1 {n['first_save_stock_over_route'] / u['first_save_stock_over_route']:.2f}x,"
        f" steady {n['steady_save_stock_over_route'] / u['steady_save_stock_over_route']:.2f}x,"
        f" load {n['load_stock_over_route'] / u['load_stock_over_route']:.2f}x"
        " (above 1: native is faster)"
    )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gib", type=float, default=1.0, help="bytes per save, GiB")
    p.add_argument("--repeat", type=int, default=3, help="steady saves and loads per route")
    p.add_argument("--quick", action="store_true", help="smoke: 64 MiB, repeat 1")
    p.add_argument("--out", default=str(RESULTS), help="JSON results file")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.repeat = 64 * MiB / GiB, 1
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # One process and no process group is the point here; DCP says so on every call.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    nbytes = int(args.gib * GiB)
    state = make_state(nbytes)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    loadavg_before = list(os.getloadavg())
    stock_root = tempfile.mkdtemp(prefix="tierckpt-bench-stock-", dir=tmpfs_root())
    try:
        with daemon(budget=None, keep_last=None) as d:  # the daemon's default configuration
            os.environ["TIERCKPT_DAEMON"] = d.address  # what DCP's fsspec route reads
            copies = memcpy_s(state, args.repeat)
            routes: dict[str, Route] = {
                "stock": Stock(stock_root),
                "native": Native(d.address, "routes-native"),
                "tierckpt://": Url("routes-url"),
            }
            warm_up(d.address, stock_root)
            figures = {name: measure(route, state, args.repeat) for name, route in routes.items()}
            copies += memcpy_s(state, args.repeat)  # again at the end: the strictest reference
    finally:
        shutil.rmtree(stock_root, ignore_errors=True)
    memcpy = min(copies)
    record: dict[str, Any] = {
        "bench": "routes",
        "machine": machine_facts(),
        "nbytes": nbytes,
        "tensors": TENSORS,
        "repeat": args.repeat,
        "warmup_saves": WARMUP_SAVES,
        "loadavg_before": loadavg_before,
        "loadavg_after": list(os.getloadavg()),
        "memcpy_s": copies,
        "memcpy_best_s": memcpy,
        "routes": {name: figures[name] for name in ROUTES},
        "ratios": ratios({name: figures[name] for name in ROUTES}, memcpy),
    }
    print(render(record))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
