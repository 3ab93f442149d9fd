"""Memory-tier benchmark: what a new user sees, next to baselines measured in the same run.

Scenarios: 1 GiB of fp32 tensors on one rank, and 2 x 512 MiB on two gloo ranks. Every
tierckpt figure uses a daemon with the default configuration (only its socket and memory
directory are set) and, unless said otherwise, a NEW `TieredStorageWriter` per save, as
torchtitan, Lightning and our examples do.

Measured per scenario (the machine is shared and noisy: read the ratios):
- memcpy: torch `copy_` between two pre-touched sets of tensors of the same bytes, with all
  cores (torch threads = cores / ranks, per rank) and with one thread, at the start and at
  the end; the memcpy reference is the fastest of all those runs;
- stock `FileSystemWriter` into tmpfs, thread_count 1 and 2; every stock save writes a NEW
  directory (a first save into a fresh dir, as tierckpt's first saves are), and the previous
  one is deleted first so tmpfs holds one stock checkpoint at a time;
- tierckpt's first saves one by one on a fresh daemon, back to back, and on another fresh
  daemon with simulated compute between saves (sleep: the CPU idles as while a GPU computes;
  `--compute busy` spins torch matmuls instead);
- `dcp.async_save` blocking time (until it returns), calls 1..N, tierckpt with a reused and
  with a new writer, stock `FileSystemWriter` + its default stager, THREAD and PROCESS;
- steady-state saves (after the first saves and `settle` more back to back, retention
  recycling old checkpoints; the settling saves are reported too) and
  loads, each load checked bit-exact, beside stock `FileSystemReader` from tmpfs.

    python bench/bench_memory_tier.py [--quick] [--gib 1.0] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tierckpt  # noqa: E402
from _harness import (  # noqa: E402
    GiB,
    MiB,
    data_path_costs,
    machine_facts,
    make_daemon,
    render_bounds,
    render_costs,
    tmpfs_root,
)
from _memory_report import render, summary  # noqa: E402
from tierckpt import TieredStorageReader, TieredStorageWriter  # noqa: E402
from tierckpt.daemon_client import DaemonClient  # noqa: E402

EXECUTORS = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


@dataclasses.dataclass(frozen=True)
class Config:
    gib: float = 1.0
    tensor_mib: int = 64
    saves: int = 5
    compute_s: float = 2.0
    compute: str = "sleep"
    repeat: int = 3
    executors: tuple[str, ...] = ("thread", "process")
    # Back-to-back saves after the first ones that are still settling: with the default
    # memory_keep_last = 2, saves #4..#7 write into segments the first saves wrote once
    # (colder pages) and the idle warmer has no time between them to touch those again.
    settle: int = 5


# --- state and checks -----------------------------------------------------------------------


def make_state(rank: int, nbytes: int, tensor_bytes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234 + rank)
    count = max(1, nbytes // tensor_bytes)
    state: dict[str, Any] = {
        f"rank{rank}.w{i}": torch.randn(tensor_bytes // 4, generator=g) for i in range(count)
    }
    state[f"rank{rank}.meta"] = {"step": 100, "rank": rank}
    return state


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {} for k, v in state.items()}


def check_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor) and not torch.equal(v, b[k]):
            raise AssertionError(f"bench restore is not bit-exact at {k}")


# --- collective plumbing (also works with no process group) ---------------------------------


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(fn: Callable[[], object]) -> float:
    """Wall time of one run, barriers on both sides: the slowest rank's time."""
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def worst_over_ranks(values: list[float]) -> list[float]:
    """Per position, the largest value any rank measured (the job waits for the slowest)."""
    if not dist.is_initialized():
        return values
    gathered: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, values)
    return [max(col) for col in zip(*gathered, strict=True)]


def shared_dir(base: str) -> str:
    """A fresh directory that every rank agrees on."""
    box = [tempfile.mkdtemp(prefix="fsw-", dir=base) if rank() == 0 else ""]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def remove_once(path: str) -> None:
    barrier()
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    barrier()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def compute_pause(cfg: Config) -> Callable[[], None]:
    """Simulated training compute between saves: idle CPU (sleep) or a busy torch loop."""

    def pause() -> None:
        barrier()
        if cfg.compute == "sleep":
            time.sleep(cfg.compute_s)
            return
        a = torch.randn(256, 256)
        deadline = time.perf_counter() + cfg.compute_s
        while time.perf_counter() < deadline:
            a = torch.tanh(a @ a)

    return pause


# --- measurements ----------------------------------------------------------------------------


def memcpy_figures(state: dict[str, Any], cfg: Config, shm: str) -> dict[str, list[float]]:
    """copy_ between pre-touched tensors: all cores, then one thread (ranks one at a time).

    Measured at the start and again at the end of a scenario; the report's memcpy is the
    fastest of all these runs (the strictest reference on a machine that others share)."""
    src = tensors_of(state)
    dst = [torch.empty_like(t) for t in src]

    def copy() -> None:
        for d, t in zip(dst, src, strict=True):
            d.copy_(t)

    copy()  # touch every destination page once: a warm copy, as the pool's pages are
    all_cores = [timed(copy) for _ in range(cfg.repeat + 1)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def one_thread() -> None:  # ranks take turns: the whole job's bytes through one thread
        for r in range(dist.get_world_size() if dist.is_initialized() else 1):
            if r == rank():
                copy()
            barrier()

    single = [timed(one_thread) for _ in range(cfg.repeat)]
    verified = [timed(lambda: verified_copy(src, dst, threads)) for _ in range(cfg.repeat + 1)]
    path = os.path.join(shm, f"verified-read-{rank()}")
    with open(path, "wb") as f:  # the same bytes in a tmpfs file, as the memory tier holds them
        for t in src:
            f.write(t.view(-1).view(torch.uint8).numpy().data)
    fd = os.open(path, os.O_RDONLY)
    try:
        read = [timed(lambda: verified_read(fd, dst, threads)) for _ in range(cfg.repeat + 1)]
    finally:
        os.close(fd)
        os.unlink(path)
    torch.set_num_threads(threads)
    return {
        "memcpy_s": all_cores,
        "memcpy_1thread_s": single,
        "verified_copy_s": verified,
        "verified_read_s": read,
    }


def verified_copy(src: list[torch.Tensor], dst: list[torch.Tensor], workers: int) -> None:
    """The fastest verified one-copy path there is on these cores: each 1 MiB copied with
    copy_ between pre-touched tensors and xxh3-128 hashed right after, from cache, by
    `workers` threads (torch threads 1 each), with no file, syscall or RPC.

    A memory-tier load (preadv + xxh3) or save (xxh3 + write) does this work and more,
    so memcpy / this is the ceiling of memcpy / load and memcpy / save on this machine
    while every byte is verified."""
    chunks = [
        (d.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8), at)
        for d, t in zip(dst, src, strict=True)
        for at in range(0, t.numel() * t.element_size(), MiB)
    ]
    share = -(-len(chunks) // workers)

    def work(part: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        for d, t, at in part:
            piece = d[at : at + MiB]
            piece.copy_(t[at : at + MiB])
            xxhash.xxh3_128_digest(piece.numpy())

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(work, [chunks[i : i + share] for i in range(0, len(chunks), share)]))


def verified_read(fd: int, dst: list[torch.Tensor], workers: int) -> None:
    """`verified_copy` with the copy made by the kernel: each 1 MiB `preadv`ed from a tmpfs
    file holding the same bytes straight into the pre-touched tensor, then xxh3-128 hashed
    from cache, by `workers` threads. A memory-tier load does exactly this plus planning
    and one daemon RPC, so memcpy / this is the ceiling of memcpy / load from a file: the
    gap between it and `verified_copy` is the kernel's page-cache copy (tmpfs pages of
    4 KiB each), which no reader of a file avoids."""
    chunks: list[tuple[memoryview, int]] = []
    at = 0
    for d in dst:
        view = memoryview(d.view(-1).view(torch.uint8).numpy())
        chunks.extend((view[lo : lo + MiB], at + lo) for lo in range(0, view.nbytes, MiB))
        at += view.nbytes
    share = -(-len(chunks) // workers)

    def work(part: list[tuple[memoryview, int]]) -> None:
        for piece, offset in part:
            os.preadv(fd, [piece], offset)
            xxhash.xxh3_128_digest(piece)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(work, [chunks[i : i + share] for i in range(0, len(chunks), share)]))


def stock_save_figures(state: dict[str, Any], cfg: Config, shm: str) -> tuple[dict[str, Any], str]:
    """Stock FileSystemWriter into tmpfs, each save a first save into a new directory."""
    out: dict[str, Any] = {}
    last = ""
    for threads in (1, 2):
        runs = []
        for _ in range(cfg.repeat):
            if last:
                remove_once(last)  # one stock checkpoint in tmpfs at a time
            path = last = shared_dir(shm)
            runs.append(
                timed(
                    lambda p=path, n=threads: dcp.save(
                        state, storage_writer=FileSystemWriter(p, thread_count=n)
                    )
                )
            )
        out[f"stock_fsw_tc{threads}_s"] = runs
    return out, last


def load_figures(state: dict[str, Any], cfg: Config, make_reader: Callable[[], Any]) -> list[float]:
    """Loads into pre-touched tensors; every one is checked bit-exact (check not timed)."""
    target = zeros_like_state(state)
    runs = []
    for _ in range(cfg.repeat):
        for t in tensors_of(target):
            t.zero_()
        runs.append(timed(lambda: dcp.load(target, storage_reader=make_reader())))
        check_equal(state, target)
    return runs


def tier_saves(
    state: dict[str, Any],
    address: str,
    namespace: str,
    steps: range,
    pause: Callable[[], None] | None = None,
) -> list[float]:
    """Sync saves one by one, each with a new TieredStorageWriter (built inside the timing)."""
    runs = []
    for step in steps:
        if pause is not None:
            pause()
        runs.append(
            timed(
                lambda s=step: dcp.save(
                    state,
                    checkpoint_id=f"step-{s:06d}",
                    storage_writer=TieredStorageWriter(namespace, daemon=address),
                )
            )
        )
    return runs


def async_series(
    calls: int,
    start: Callable[[int], Any],
    after: Callable[[int], None] | None = None,
    last: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """`calls` async_saves one after the other: blocking time and time until durable.

    `start(i)` builds its writer first (not timed), then returns a callable issuing the
    async_save; the blocking time is the time that call takes to return.
    """
    blocking, total = [], []
    for i in range(calls):
        issue = start(i)
        barrier()
        t0 = time.perf_counter()
        fut = issue()
        blocking.append(time.perf_counter() - t0)
        fut.result()
        total.append(time.perf_counter() - t0)
        del issue, fut
        gc.collect()  # free this call's writer and staged copy now, not at some later call
        if after is not None:
            after(i)
    if last is not None:
        last()  # free the series' checkpoints and staging before the next series
    return {"blocking_s": worst_over_ranks(blocking), "until_durable_s": worst_over_ranks(total)}


def async_figures(
    state: dict[str, Any], cfg: Config, shm: str
) -> dict[str, dict[str, list[float]]]:
    """Per executor a fresh daemon: pool segments stay with their namespace after it is
    deleted, so one daemon for every series would hold several GiB of dead pages."""
    out: dict[str, dict[str, list[float]]] = {}
    for executor in cfg.executors:
        if executor == "process":
            _start_process_executor(shm)
        with fresh_daemon() as address:
            out.update(async_for_executor(state, cfg.saves, executor, address, shm))
    return out


def async_for_executor(
    state: dict[str, Any], calls: int, executor: str, address: str, shm: str
) -> dict[str, dict[str, list[float]]]:
    """Stock first, then tierckpt with one writer reused, then a new writer per call."""
    kind = EXECUTORS[executor]
    stock_dirs: list[str] = []

    def stock(i: int) -> Callable[[], Any]:
        stock_dirs.append(shared_dir(shm))  # a new directory per call, removed once durable
        writer = FileSystemWriter(stock_dirs[-1])
        return lambda: dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind)

    reused = TieredStorageWriter(f"async-reused-{executor}", daemon=address)

    def tier(i: int, writer: TieredStorageWriter | None = None) -> Callable[[], Any]:
        writer = writer or TieredStorageWriter(f"async-new-{executor}", daemon=address)
        return lambda: dcp.async_save(
            state,
            checkpoint_id=f"step-{i + 1:06d}",
            storage_writer=writer,
            async_checkpointer_type=kind,
        )

    return {
        f"stock {executor}": async_series(calls, stock, after=lambda i: remove_once(stock_dirs[i])),
        f"tierckpt {executor} reused writer": async_series(
            calls, lambda i: tier(i, reused), last=lambda: forget(address, reused.namespace)
        ),
        f"tierckpt {executor} new writer": async_series(
            calls, tier, last=lambda: forget(address, f"async-new-{executor}")
        ),
    }


def _start_process_executor(shm: str) -> None:
    """Start torch's checkpoint process with a tiny save, so that no series pays for it."""
    path = shared_dir(shm)
    dcp.async_save(
        {f"warmup{rank()}": torch.zeros(4)},
        storage_writer=FileSystemWriter(path),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    ).result()
    remove_once(path)


def suite(rank_id: int, world: int, cfg: Config, shm: str) -> dict[str, Any]:
    """Everything for one scenario, on this rank; the figures are the slowest rank's."""
    nbytes = int(cfg.gib * GiB) // world
    state = make_state(rank_id, nbytes, cfg.tensor_mib * MiB)
    res: dict[str, Any] = {
        "title": f"{world} rank(s) x {nbytes / GiB:.2f} GiB",
        "world": world,
        "bytes": nbytes * world,
        "torch_threads_per_rank": torch.get_num_threads(),
        "compute": f"{cfg.compute} {cfg.compute_s:g} s",
    }
    memcpy = memcpy_figures(state, cfg, shm)
    stock, stock_path = stock_save_figures(state, cfg, shm)
    res.update(stock)
    res["stock_load_s"] = load_figures(state, cfg, lambda: FileSystemReader(stock_path))
    remove_once(stock_path)

    n = cfg.saves
    with fresh_daemon() as a:  # first saves back to back, then steady state and loads
        res["first_saves_back_to_back_s"] = tier_saves(state, a, "first", range(1, n + 1))
        after = tier_saves(state, a, "first", range(n + 1, n + 1 + cfg.settle + cfg.repeat))
        res["settling_saves_s"] = after[: cfg.settle]
        res["steady_saves_s"] = after[cfg.settle :]
        res["load_s"] = load_figures(state, cfg, lambda: TieredStorageReader("first", daemon=a))
    with fresh_daemon() as b:  # first saves with simulated compute before each (#1 too)
        res["first_saves_with_compute_s"] = tier_saves(
            state, b, "first", range(1, n + 1), pause=compute_pause(cfg)
        )
    res["async"] = async_figures(state, cfg, shm)
    again = memcpy_figures(state, cfg, shm)
    res.update({key: memcpy[key] + again[key] for key in memcpy})
    return res


_DAEMON_LIST = tempfile.gettempdir()  # the parent's per-scenario directory, in the ranks


@contextlib.contextmanager
def fresh_daemon() -> Iterator[str]:
    """A new tierckptd with the default configuration for one phase; every rank gets its
    address. Rank 0 owns it and stops it (memory wiped) when the phase ends, so that the
    phases' checkpoints never add up in RAM (the machine also runs other jobs)."""
    d = make_daemon(budget=None, keep_last=None) if rank() == 0 else None
    if d is not None:
        d.start()
        assert d.proc is not None
        # If this rank dies (e.g. the OOM killer), the parent stops what is listed here.
        listed = Path(_DAEMON_LIST, f"daemon-{d.proc.pid}.json")
        record = {"pid": d.proc.pid, "config": d.config_path, "dirs": [d.root, d.memory_dir]}
        listed.write_text(json.dumps(record))
    box = [d.address if d is not None else ""]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    try:
        yield box[0]
    finally:
        barrier()
        if d is not None:
            d.stop()
            listed.unlink()


def forget(address: str, namespace: str) -> None:
    """Delete a namespace's checkpoints and its staging buffers between series (untimed):
    deleted files become pool pages the next series reuses instead of new RAM."""
    barrier()
    if rank() == 0:
        client = DaemonClient(address)
        for info in client.list_checkpoints(namespace):
            client.delete_checkpoint(namespace, info.checkpoint_id)
        client.close()
    # Process-owned staging (when this tierckpt has it) outlives writers: release it too.
    release = getattr(tierckpt, "release_staging", None)
    if release is not None:
        release(namespace)
    barrier()


# --- processes -------------------------------------------------------------------------------


def _rank_main(
    rank_id: int,
    world: int,
    store_dir: str,
    cfg: Config,
    shm: str,
    out: str,
) -> None:
    # The ranks' output (and torch's PROCESS executor's INFO chatter, which it inherits)
    # goes to a log the parent shows only on failure; the tables come from the parent.
    log = os.open(os.path.join(store_dir, "ranks.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    global _DAEMON_LIST
    _DAEMON_LIST = store_dir
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "gloo", init_method=f"file://{store_dir}/store", rank=rank_id, world_size=world
    )
    try:
        res = suite(rank_id, world, cfg, shm)
        if rank_id == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def run_scenario(world: int, cfg: Config, shm: str) -> dict[str, Any]:
    """Spawn `world` gloo ranks (1 included: the PROCESS executor needs a process group)."""
    with tempfile.TemporaryDirectory() as store:
        out = os.path.join(store, "result.json")
        try:
            mp.start_processes(
                _rank_main,
                args=(world, store, cfg, shm, out),
                nprocs=world,
                start_method="spawn",
            )
        except Exception:
            with contextlib.suppress(OSError):
                print(Path(store, "ranks.log").read_text()[-6000:], file=sys.stderr)
            raise
        finally:
            _stop_orphans(store)
        result: dict[str, Any] = json.loads(Path(out).read_text())
        return result


def _stop_orphans(store: str) -> None:
    """Stop the daemons a dead rank 0 left behind (they hold GiBs of tmpfs)."""
    for listed in Path(store).glob("daemon-*.json"):
        record = json.loads(listed.read_text())
        with contextlib.suppress(OSError):  # only if that pid is still that daemon
            if record["config"] in Path(f"/proc/{record['pid']}/cmdline").read_text():
                os.kill(record["pid"], signal.SIGKILL)
        for path in record["dirs"]:
            shutil.rmtree(path, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke: 32 MiB, 2 saves, best of 1, THREAD"
    )
    parser.add_argument("--gib", type=float, help="GiB in total per scenario (default 1)")
    parser.add_argument("--saves", type=int, help="first saves / async calls (default 5)")
    parser.add_argument("--compute-seconds", type=float, help="between saves (default 2)")
    parser.add_argument("--compute", choices=("sleep", "busy"), default="sleep")
    parser.add_argument("--repeat", type=int, help="runs of each best-of figure (default 3)")
    parser.add_argument(
        "--executors", help="comma-separated async executors (default thread,process)"
    )
    parser.add_argument("--worlds", default="1,2", help="rank counts to run (default 1,2)")
    parser.add_argument("--out", help="JSON results (default bench/results/memory_tier.json)")
    parser.add_argument(
        "--tmpfs",
        help="tmpfs directory for the memory tier and the tmpfs baselines (default /dev/shm); "
        "e.g. a mount with huge=within_size",
    )
    args = parser.parse_args(argv)
    base = (
        Config(
            gib=1 / 32,
            tensor_mib=8,
            saves=2,
            compute_s=0.1,
            repeat=1,
            executors=("thread",),
            settle=1,
        )
        if args.quick
        else Config()
    )
    cfg = dataclasses.replace(
        base,
        gib=args.gib if args.gib is not None else base.gib,
        saves=args.saves if args.saves is not None else base.saves,
        compute_s=args.compute_seconds if args.compute_seconds is not None else base.compute_s,
        compute=args.compute,
        repeat=args.repeat if args.repeat is not None else base.repeat,
        executors=tuple(args.executors.split(",")) if args.executors else base.executors,
    )
    if cfg.saves < 2 or cfg.repeat < 1 or any(e not in EXECUTORS for e in cfg.executors):
        parser.error("--saves >= 2, --repeat >= 1, executors among thread,process")
    return cfg, args


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_args(argv)
    if args.tmpfs:
        os.environ["TIERCKPT_BENCH_TMPFS"] = args.tmpfs  # inherited by the spawned ranks
    facts = machine_facts()
    started = time.perf_counter()
    shm = tempfile.mkdtemp(prefix="tierckpt-bench-fsw-", dir=tmpfs_root())
    scenarios = []
    try:
        costs = data_path_costs(shm, nbytes=(32 if args.quick else 256) * MiB)
        print(render_costs(costs), flush=True)
        for world in (int(w) for w in args.worlds.split(",")):
            res = run_scenario(world, cfg, shm)
            print(render(res, cfg.saves), flush=True)
            scenarios.append(res)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    checks = summary(scenarios)
    facts["bench_seconds"] = round(time.perf_counter() - started, 1)
    print(checks["text"], flush=True)
    print(render_bounds(costs, scenarios), flush=True)
    print(f"(bench took {facts['bench_seconds']} s)", flush=True)
    out = (
        Path(args.out)
        if args.out
        else Path(__file__).resolve().parent / "results" / ("memory_tier.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join(["python", "bench/bench_memory_tier.py", *(argv or sys.argv[1:])]),
        "machine": facts,
        "config": dataclasses.asdict(cfg),
        "scenarios": scenarios,
        "done_when": checks["items"],
        "data_path_core_s_per_gib": costs,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
