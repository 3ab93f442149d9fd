"""SageMaker API bench: the seed's own client through tierckptd's `[listen] sagemaker`,
beside tierckpt's native writer/reader and (optional) the seed's stand-in server.

Why: issue 24 serves SageMaker HyperPod's checkpointing HTTP API so that its unmodified
client saves into tierckpt's tiers; a user needs to know what the HTTP route costs next
to the native one on the same daemon, and next to the server the client's own tests run
against, in the same run (the machine is shared: read the ratios, not the seconds).

One rank, no process group, one fp32 tensor of `--gib` (a 1 GiB rank blob), ONE tierckptd:

- seed -> tierckptd: `dcp.save(storage_writer=SageMakerTieredStorageWriter(step=N))` and
  `dcp.load(storage_reader=SageMakerTieredStorageReader(step=N))` of
  ``amzn-sagemaker-checkpointing`` 1.1.3, unchanged; its fixed address reaches the
  daemon through ``HTTP_PROXY`` (absolute-form targets, as the tests do);
- native: `TieredStorageWriter` / `TieredStorageReader` on the same daemon;
- seed -> stand-in: the same seed calls against the server the client's own tests run
  against (``tests/local_tests/membrain_server``, a FastAPI app, served by uvicorn), from
  the 1.1.3 sdist: ``--standin-sdist DIR`` (unpacked), else downloaded with
  ``pip download --no-binary :all: --no-deps`` into a temporary directory. The client
  reaches it as its own tests do, by its ``base_url`` (`InMemoryClientConfig`), not
  through ``HTTP_PROXY``: the stand-in does not route absolute-form targets (404). The
  column is skipped, with the reason printed, when the sdist cannot be had or fastapi /
  uvicorn are missing (``--no-standin`` skips it outright).

Per route: `--repeat` saves (the previous step deleted first, untimed), the fastest
after the first is "steady"; every load is checked bit-exact (untimed).

    python bench/bench_sagemaker_api.py [--quick] [--gib 1.0] [--repeat 3]
        [--standin-sdist DIR | --no-standin]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import requests
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import GiB, MiB, machine_facts, make_daemon  # noqa: E402
from tierckpt import TieredStorageReader, TieredStorageWriter  # noqa: E402
from tierckpt.daemon_client import DaemonClient  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "sagemaker_api.json"
NS = "bench-seed"
SEED = "amzn-sagemaker-checkpointing==1.1.3"
_PROXY_VARS = ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in _PROXY_VARS}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def proxied(port: int) -> Iterator[None]:
    """The seed client's fixed address to 127.0.0.1:`port` through ``HTTP_PROXY`` (what
    the node-local Service does: the client unchanged, its requests in absolute form)."""
    proxy = f"http://127.0.0.1:{port}"
    with _environ(HTTP_PROXY=proxy, http_proxy=proxy, NO_PROXY=None, no_proxy=None):
        yield


@contextlib.contextmanager
def direct(port: int) -> Iterator[None]:
    """The seed client's `base_url` set to 127.0.0.1:`port`, as its own local tests set
    it (`tests/local_tests/common.py`: every client made without a config gets one)."""
    from amzn_sagemaker_checkpointing.config.in_memory_client import InMemoryClientConfig
    from amzn_sagemaker_checkpointing.storage.clients.inmemory import inmemory_client

    cls = inmemory_client.InMemoryCheckpointClient
    original = cls.__init__

    def init(self: Any, *args: Any, config: Any = None, **kwargs: Any) -> None:
        config = config or InMemoryClientConfig(base_url=f"http://127.0.0.1:{port}")
        original(self, *args, config=config, **kwargs)

    cls.__init__ = init  # type: ignore[method-assign]
    try:
        with _environ(HTTP_PROXY=None, http_proxy=None, NO_PROXY="127.0.0.1", no_proxy=None):
            yield
    finally:
        cls.__init__ = original  # type: ignore[method-assign]


class Seed:
    """The seed client's writer and reader against an HTTP server on `port`, reached
    through `reach` (`proxied` or `direct`)."""

    def __init__(
        self, port: int, reach: Callable[[int], contextlib.AbstractContextManager[None]]
    ) -> None:
        from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import (
            SageMakerCheckpointConfig,
        )

        self.port = port
        self.reach = reach
        self.config = SageMakerCheckpointConfig(namespace=NS, world_size=1)

    def save(self, state: dict[str, Any], step: int) -> None:
        from amzn_sagemaker_checkpointing.checkpointing.filesystem import (
            SageMakerTieredStorageWriter,
        )

        with self.reach(self.port):
            writer = SageMakerTieredStorageWriter(checkpoint_config=self.config, step=step)
            dcp.save(state, storage_writer=writer, no_dist=True)

    def load(self, target: dict[str, Any], step: int) -> None:
        from amzn_sagemaker_checkpointing.checkpointing.filesystem import (
            SageMakerTieredStorageReader,
        )

        with self.reach(self.port):
            reader = SageMakerTieredStorageReader(checkpoint_config=self.config, step=step)
            dcp.load(target, storage_reader=reader, no_dist=True)

    def delete(self, step: int) -> None:
        for rank in (0, 1):  # the data blob and the metadata blob (tierckptd: the step)
            requests.delete(f"http://127.0.0.1:{self.port}/v1/cp/checkpoints/{NS}/{rank}/{step}")


class Native:
    def __init__(self, address: str) -> None:
        self.address = address
        self.client = DaemonClient(address)

    def save(self, state: dict[str, Any], step: int) -> None:
        writer = TieredStorageWriter(NS + "-native", daemon=self.address)
        dcp.save(state, checkpoint_id=f"step_{step}", storage_writer=writer, no_dist=True)

    def load(self, target: dict[str, Any], step: int) -> None:
        reader = TieredStorageReader(NS + "-native", daemon=self.address)
        dcp.load(target, checkpoint_id=f"step_{step}", storage_reader=reader, no_dist=True)

    def delete(self, step: int) -> None:
        self.client.delete_checkpoint(NS + "-native", f"step_{step}")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(route: Any, state: dict[str, Any], repeat: int) -> dict[str, Any]:
    saves, loads = [], []
    for step in range(1, repeat + 2):
        if step > 1:
            route.delete(step - 1)
        saves.append(_timed(lambda: route.save(state, step)))  # noqa: B023
        target = {"w": torch.zeros_like(state["w"])}
        loads.append(_timed(lambda: route.load(target, step)))  # noqa: B023
        if not torch.equal(target["w"], state["w"]):
            raise AssertionError(f"{type(route).__name__}: step {step} loaded different bytes")
    return {
        "saves_s": saves,
        "loads_s": loads,
        "first_save_s": saves[0],
        "steady_save_s": min(saves[1:]),
        "best_load_s": min(loads),
    }


def fetch_sdist(into: str) -> str:
    """The 1.1.3 sdist downloaded into `into` and unpacked; its root (RuntimeError with
    pip's last words when it cannot be had, e.g. offline)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        + ["--disable-pip-version-check", "-q", "-d", into, SEED],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    archives = sorted(Path(into).glob("*.tar.gz"))
    if proc.returncode != 0 or not archives:
        raise RuntimeError(f"pip download {SEED} failed: {proc.stderr.strip()[-300:]}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(into, filter="data")
    roots = [p for p in Path(into).iterdir() if (p / "tests" / "local_tests").is_dir()]
    if not roots:
        raise RuntimeError(f"{archives[0].name} has no tests/local_tests (the stand-in)")
    return str(roots[0])


@contextlib.contextmanager
def standin_sdist(given: str, enabled: bool) -> Iterator[tuple[str | None, str]]:
    """(the unpacked sdist's root, "") or (None, why the stand-in column is skipped)."""
    if not enabled:
        yield None, "--no-standin"
        return
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        yield None, f"{' and '.join(missing)} not installed (the stand-in is a FastAPI app)"
        return
    if given:
        if not (Path(given) / "tests" / "local_tests" / "membrain_server.py").is_file():
            yield None, f"--standin-sdist {given}: no tests/local_tests/membrain_server.py there"
        else:
            yield given, ""
        return
    with tempfile.TemporaryDirectory(prefix="seed-sdist-") as tmp:
        try:
            root = fetch_sdist(tmp)
        except (RuntimeError, OSError, subprocess.SubprocessError, tarfile.TarError) as e:
            yield None, f"the {SEED} sdist is not available: {e}"
            return
        yield root, ""


@contextlib.contextmanager
def standin(sdist: str) -> Iterator[int]:
    """The seed's stand-in server (fastapi + uvicorn) from its sdist, on a free port."""
    port = _free_port()
    code = (
        "import uvicorn\nfrom tests.local_tests.membrain_server import app\n"
        f"uvicorn.run(app, host='127.0.0.1', port={port}, log_level='warning')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=sdist)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the stand-in did not start (fastapi and uvicorn installed?)")
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def render(record: dict[str, Any]) -> str:
    nbytes, routes = record["nbytes"], record["routes"]
    out = [
        f"\n## SageMaker API, 1 rank, {nbytes / GiB:.3f} GiB blob"
        f" (load average {record['loadavg_before'][0]:.2f} before,"
        f" {record['loadavg_after'][0]:.2f} after)",
        f"{'route':<22} {'save #1 s':>9} {'steady s':>9} {'load s':>8} {'steady GB/s':>11}",
    ]
    for name, f in routes.items():
        out.append(
            f"{name:<22} {f['first_save_s']:>9.3f} {f['steady_save_s']:>9.3f}"
            f" {f['best_load_s']:>8.3f} {nbytes / f['steady_save_s'] / 1e9:>11.2f}"
        )
    out.append("ratios (route time / seed -> tierckptd time; above 1: the HTTP route is faster):")
    for name, r in record["ratios"].items():
        out.append(f"  {name:<20} save {r['steady_save']:.2f}x, load {r['load']:.2f}x")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gib", type=float, default=1.0, help="bytes of the rank blob, GiB")
    p.add_argument("--repeat", type=int, default=3, help="steady saves and loads per route")
    p.add_argument("--quick", action="store_true", help="smoke: 16 MiB, repeat 1")
    p.add_argument(
        "--standin-sdist", default="", help="unpacked 1.1.3 sdist (default: pip download it)"
    )
    p.add_argument(
        "--no-standin", action="store_true", help="skip the stand-in column (no download)"
    )
    p.add_argument("--out", default=str(RESULTS), help="JSON results file")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.repeat = 16 * MiB / GiB, 1
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = {"w": torch.randn(int(args.gib * GiB) // 4, generator=torch.Generator().manual_seed(7))}
    nbytes = state["w"].numel() * 4
    port = _free_port()
    loadavg_before = list(os.getloadavg())
    d = make_daemon(budget="16GiB")
    config = Path(d.config_path)  # [listen] sagemaker, beside the socket make_daemon writes
    listen = f'[listen]\nsagemaker = "127.0.0.1:{port}"\n'
    config.write_text(config.read_text().replace("[listen]\n", listen, 1))
    skipped = ""
    d.start()
    try:
        figures = {
            "seed -> tierckptd": measure(Seed(port, proxied), state, args.repeat),
            "native": measure(Native(d.address), state, args.repeat),
        }
        with standin_sdist(args.standin_sdist, not args.no_standin) as (sdist, skipped):
            if sdist is not None:
                with standin(sdist) as standin_port:
                    seed = Seed(standin_port, direct)
                    figures["seed -> stand-in"] = measure(seed, state, args.repeat)
    finally:
        d.stop()
    if skipped:
        print(f"stand-in column skipped: {skipped}")
    http = figures["seed -> tierckptd"]
    record: dict[str, Any] = {
        "bench": "sagemaker_api",
        "machine": machine_facts(),
        "nbytes": nbytes,
        "repeat": args.repeat,
        "loadavg_before": loadavg_before,
        "loadavg_after": list(os.getloadavg()),
        "routes": figures,
        "standin_skipped": skipped,
        "ratios": {
            name: {
                "steady_save": f["steady_save_s"] / http["steady_save_s"],
                "load": f["best_load_s"] / http["best_load_s"],
            }
            for name, f in figures.items()
            if name != "seed -> tierckptd"
        },
    }
    print(render(record))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
