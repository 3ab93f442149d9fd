"""Shared bench plumbing: a throwaway tierckptd, timers, and the ratio table."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The benches reuse the tests' helpers (tests/support) instead of copies of them.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.support.ports import free_ports as free_ports  # noqa: E402  (re-exported)

GiB = 1 << 30
MiB = 1 << 20


def tmpfs_root() -> str:
    """Where tmpfs files go: $TIERCKPT_BENCH_TMPFS (e.g. a huge-page tmpfs), else /dev/shm."""
    chosen = os.environ.get("TIERCKPT_BENCH_TMPFS")
    if chosen:
        return chosen
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass
class Daemon:
    """A real tierckptd on a unix socket with its memory tier in tmpfs."""

    root: str
    address: str
    memory_dir: str
    config_path: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        with open(os.path.join(self.root, "daemon.log"), "ab") as log:  # the child keeps a copy
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierckptd", "--config", self.config_path],
                stdout=log,
                stderr=log,
            )
        _wait_serving(self)
        return self

    def kill9_and_wipe(self) -> None:
        """The node dies with its RAM: SIGKILL, then its memory tier is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.memory_dir, ignore_errors=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.memory_dir, ignore_errors=True)


def make_daemon(
    *,
    node_id: str = "bench",
    budget: str | None = "16GiB",
    keep_last: int | None = 1,
    peer: str = "",
    extra: str = "",
) -> Daemon:
    """Write a config and return an unstarted daemon (call .start()).

    `budget` or `keep_last` None leaves the key out, so the daemon's own default applies:
    a bench of "what a new user sees" must not tune the daemon behind the user's back.
    """
    root = tempfile.mkdtemp(prefix="tcb")
    memory_dir = tempfile.mkdtemp(prefix="tierckpt-bench-", dir=tmpfs_root())
    sock = os.path.join(root, "d.sock")
    config = os.path.join(root, "tierckptd.toml")
    budget_line = f'budget = "{budget}"\n' if budget is not None else ""
    keep_line = f"memory_keep_last = {keep_last}\n" if keep_last is not None else ""
    with open(config, "w") as f:
        f.write(
            f'[node]\nid = "{node_id}"\nfailure_domain = "{node_id}"\n'
            f'[listen]\nlocal = "unix://{sock}"\npeer = "{peer}"\n'
            f'[memory]\ndir = "{memory_dir}"\n{budget_line}'
            f"[retention]\n{keep_line}{extra}"
        )
    return Daemon(root, f"unix://{sock}", memory_dir, config)


@contextlib.contextmanager
def daemon(
    budget: str | None = "16GiB", keep_last: int | None = 1, extra: str = ""
) -> Iterator[Daemon]:
    """A started single-node daemon, stopped and wiped on exit (None: the daemon's default)."""
    d = make_daemon(budget=budget, keep_last=keep_last, extra=extra)
    try:
        yield d.start()
    finally:
        d.stop()


def _wait_serving(d: Daemon, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc is not None and d.proc.poll() is not None:
            raise RuntimeError(
                f"tierckptd exited with {d.proc.returncode}; see {d.root}/daemon.log"
            )
        with contextlib.suppress(grpc.RpcError), grpc.insecure_channel(d.address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1
            )
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
        time.sleep(0.1)
    raise TimeoutError("tierckptd did not become SERVING")


def machine_facts() -> dict[str, object]:
    """What a reader needs to compare two runs: cores, memory, versions, where tmpfs is."""
    import platform

    import torch

    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        pages = 0
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(pages / GiB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "tmpfs": tmpfs_root(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def best_of(
    fn: Callable[[], object], repeat: int = 3, setup: Callable[[], object] | None = None
) -> float:
    """Fastest of `repeat` runs, in seconds (least disturbed by the shared machine)."""
    best = float("inf")
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class Table:
    title: str
    nbytes: int
    rows: list[tuple[str, float, str]] = field(default_factory=list)

    def add(self, name: str, seconds: float, note: str = "") -> float:
        self.rows.append((name, seconds, note))
        return seconds

    def seconds(self, name: str) -> float:
        return next(s for n, s, _ in self.rows if n == name)

    def render(self, ratios: list[tuple[str, str, str]]) -> str:
        out = [
            f"\n## {self.title} ({self.nbytes / GiB:.2f} GiB)",
            f"{'measurement':<48} {'seconds':>9} {'GB/s':>8}  note",
        ]
        for name, s, note in self.rows:
            out.append(f"{name:<48} {s:>9.3f} {self.nbytes / s / 1e9:>8.2f}  {note}")
        out.append("ratios (higher is better for tierckpt):")
        for label, num, den in ratios:
            out.append(f"  {label:<62} {self.seconds(den) / self.seconds(num):>6.2f}x")
        return "\n".join(out)


def data_path_costs(directory: str, nbytes: int = 256 * MiB, repeat: int = 5) -> dict[str, float]:
    """CPU seconds per GiB on one core of what a memory-tier save and load are made of.

    Thread CPU time, not wall time: the cost of the work itself, hardly moved by other
    jobs on a shared machine. A save is write(2) into a warm tmpfs file plus xxh3 of the
    same bytes; a load is preadv from it plus xxh3; both are set beside a memcpy (torch
    ``copy_`` between pre-touched tensors), so ``memcpy / (write + xxh3)`` bounds how
    close to memcpy a save can get on the same cores (the same for a load)."""
    import torch
    import xxhash

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    s_view = memoryview(src.numpy()).cast("B")
    d_view = memoryview(dst.numpy()).cast("B")
    step = MiB  # the memory tier's I/O chunk (tierckpt.memory_files._IO_CHUNK)
    fd, path = tempfile.mkstemp(prefix="tierckpt-bench-costs-", dir=directory)
    try:
        os.pwrite(fd, s_view, 0)  # warm pages, as the pool's segments are

        def write() -> None:
            for at in range(0, nbytes, step):
                os.pwrite(fd, s_view[at : at + step], at)

        def read() -> None:
            for at in range(0, nbytes, step):
                os.preadv(fd, [d_view[at : at + step]], at)

        def hash_() -> None:
            for at in range(0, nbytes, MiB):
                xxhash.xxh3_128_digest(s_view[at : at + MiB])

        def cpu(fn: Callable[[], object]) -> float:
            best = float("inf")
            for _ in range(repeat):
                start = time.thread_time()
                fn()
                best = min(best, time.thread_time() - start)
            return best * GiB / nbytes

        costs = {
            "memcpy": cpu(lambda: dst.copy_(src)),
            "write(2)": cpu(write),
            "preadv": cpu(read),
            "xxh3": cpu(hash_),
        }
    finally:
        os.close(fd)
        os.unlink(path)
        torch.set_num_threads(threads)
    return costs


def render_costs(costs: dict[str, float]) -> str:
    """The per-byte costs of the save's and the load's work, beside a memcpy's."""
    lines = ["\n## Data path, CPU seconds per GiB on one core (thread CPU time)"]
    lines += [f"  {name:<10} {s:.3f} core-s/GiB  ({1 / s:.1f} GiB/s)" for name, s in costs.items()]
    return "\n".join(lines)


def render_bounds(costs: dict[str, float], scenarios: list[dict[str, Any]]) -> str:
    """The best memcpy/save and memcpy/load each scenario's cores allow.

    Made of ratios measured moments apart, so that a load on the machine cancels out:
    per core, a memcpy costs ``memcpy / (write(2) + xxh3)`` of a save's CPU (resp.
    preadv for a load); a save spreads perfectly over every core, while the scenario's
    memcpy reference gains `speedup` over one thread (memory bandwidth caps it)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    lines = [f"\n## Estimated bounds from the data path's CPU cost ({cores} cores, no other cost)"]
    for res in scenarios:
        ratios = res["ratios"]
        speedup = max(1.0, min(res["memcpy_1thread_s"]) / ratios["memcpy_ref_s"])
        save = costs["memcpy"] / (costs["write(2)"] + costs["xxh3"]) * cores / speedup
        load = costs["memcpy"] / (costs["preadv"] + costs["xxh3"]) * cores / speedup
        lines.append(
            f"  {res['title']:<22} memcpy/save <= {save:.2f} (measured "
            f"{ratios['steady_memcpy_over_save']:.2f}); memcpy/load <= {load:.2f} "
            f"(measured {ratios['load_memcpy_over_load']:.2f}); memcpy speedup on "
            f"{cores} cores {speedup:.2f}"
        )
    return "\n".join(lines)
