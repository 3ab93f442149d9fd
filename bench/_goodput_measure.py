"""The costs bench/goodput.py needs that no other bench writes down, measured here quickly.

Real daemons on loopback, a moto S3 server in a subprocess, 256 MiB (`--measure-mib`) of fp32
tensors (64 MiB each) saved by one rank:
- replication: a save on node a (copies = 1) until the checkpoint is REPLICATED;
- peer restore: node a killed with its memory, restarted empty, EnsureLocal of every file
  (the replacement right after READY: nothing preallocated);
- drain: a save on a daemon with [persistent] (compression none) until DURABLE;
- S3 read: every drained data file read back with s3fs, 4 at a time (what a rank does).
Each is the best of two, beside a raw grpcio stream of the same bytes on loopback (how busy
the cores were). All run on the machine's shared cores, so they are floors for a fleet node
(more cores, a real NIC, real S3), not estimates of one.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _harness import Daemon, MiB, free_ports, machine_facts, make_daemon
from bench_peer_tier import raw_grpc_stream
from bench_persistent_tier import start_moto
from tierckpt import TieredStorageWriter
from tierckpt.daemon_client import CheckpointInfo, DaemonClient
from tierckpt.errors import CheckpointNotFound

NS = "bench-goodput"
BUCKET = "goodput"
TENSOR = 64 * MiB
REPEAT = 2


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    return {f"w{i}": torch.randn(TENSOR // 4, generator=g) for i in range(nbytes // TENSOR)}


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _save(state: dict[str, torch.Tensor], address: str, checkpoint_id: str) -> None:
    dcp.save(
        state, checkpoint_id=checkpoint_id, storage_writer=TieredStorageWriter(NS, daemon=address)
    )


def _until(address: str, checkpoint_id: str, state: str, timeout: float = 120.0) -> float:
    """Seconds until `checkpoint_id` reaches `state` on the daemon at `address`."""
    client = DaemonClient(address)
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if {c.checkpoint_id: c.state for c in client.list_checkpoints(NS)}.get(
            checkpoint_id
        ) == state:
            return time.perf_counter() - started
        time.sleep(0.02)
    raise TimeoutError(f"{checkpoint_id} did not become {state} in {timeout:.0f} s")


def _learnt(client: DaemonClient, checkpoint_id: str, timeout: float = 60.0) -> CheckpointInfo:
    """The checkpoint as a replacement knows it, once it has learnt it from its buddy."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.get_checkpoint(NS, checkpoint_id)
        except CheckpointNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _pair() -> list[Daemon]:
    ports = free_ports(2)
    nodes = []
    for i in range(2):
        j = 1 - i
        extra = (
            "[replication]\ncopies = 1\nheal_interval = 3600.0\n"
            f'[[peers]]\nid = "node{j}"\naddress = "127.0.0.1:{ports[j]}"\nfailure_domain = "node{j}"\n'
        )
        nodes.append(
            make_daemon(
                node_id=f"node{i}",
                budget="1GiB",
                keep_last=2,
                peer=f"127.0.0.1:{ports[i]}",
                extra=extra,
            )
        )
    return [node.start() for node in nodes]


def _parallel(fn: Callable[[str], Any], names: list[str]) -> None:
    with futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(fn, names))


def peer_costs(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Replication and replacement-node restore throughput, GB/s."""
    nbytes = _nbytes(state)
    a, b = nodes = _pair()
    try:
        _save(state, a.address, "warm")  # the first save of a fresh daemon pays for new pages
        replicate, restore = [], []
        for k in range(REPEAT):
            cid = f"step-{k:03d}"
            _save(state, a.address, cid)
            replicate.append(nbytes / _until(a.address, cid, "REPLICATED") / 1e9)
        for _ in range(REPEAT):
            a.kill9_and_wipe()
            a.start()
            client = DaemonClient(a.address)
            info = _learnt(client, cid)
            data = [f.name for f in info.files if f.name.endswith(".distcp")]
            size = sum(f.size for f in info.files if f.name in data)
            started = time.perf_counter()
            _parallel(functools.partial(client.ensure_local, NS, cid), data)
            restore.append(size / (time.perf_counter() - started) / 1e9)
    finally:
        for node in nodes:
            node.stop()
    return {"replicate_gbps": max(replicate), "peer_restore_gbps": max(restore)}


def s3_costs(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Drain (upload) and S3 read-back throughput of one node, GB/s, against moto."""
    nbytes = _nbytes(state)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    moto, endpoint = start_moto()
    d: Daemon | None = None
    try:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=endpoint)
        fs.mkdir(BUCKET)
        extra = (
            f'[persistent]\nurl = "s3://{BUCKET}"\ncompression = "none"\nevery = 1\n'
            f'storage_options = {{ endpoint_url = "{endpoint}" }}\n'
        )
        d = make_daemon(node_id="drain", budget="1GiB", keep_last=2, extra=extra).start()
        drain, read = [], []
        for k in range(REPEAT):
            cid = f"step-{k:03d}"
            _save(state, d.address, cid)
            drain.append(nbytes / _until(d.address, cid, "DURABLE") / 1e9)
            fs.invalidate_cache()
            files = [p for p in fs.find(f"{BUCKET}/{NS}/{cid}") if p.endswith(".distcp")]
            if not files:
                raise RuntimeError(f"{cid} is DURABLE but S3 lists no data file under {NS}/{cid}")
            started = time.perf_counter()
            _parallel(fs.cat_file, files)
            read.append(sum(fs.size(p) for p in files) / (time.perf_counter() - started) / 1e9)
    finally:
        if d is not None:
            d.stop()
        moto.terminate()
        moto.wait(10)
    return {"drain_gbps": max(drain), "s3_read_gbps": max(read)}


def measure(mib: int = 256) -> dict[str, Any]:
    """Every cost above for `mib` MiB (a multiple of 64), with the machine's facts, as
    bench/results/goodput_costs.json holds."""
    if mib < 64 or mib % 64 or mib > 4096:
        raise ValueError(f"measure size {mib} MiB: use a multiple of 64 from 64 to 4096")
    nbytes = mib * MiB
    started = time.perf_counter()
    load_before = os.getloadavg()
    state = _state(nbytes)
    costs = {**peer_costs(state), **s3_costs(state)}
    raw = nbytes / raw_grpc_stream(nbytes) / 1e9  # same-run context: how loaded the cores were
    facts = machine_facts()
    facts["bench_seconds"] = round(time.perf_counter() - started, 1)
    facts["loadavg_before"] = [round(x, 2) for x in load_before]
    facts["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return {
        "command": "python bench/goodput.py --measure",
        "machine": facts,
        "bytes": nbytes,
        "tensors": len(state),
        "repeat": REPEAT,
        "costs": costs,
        "baseline": {"raw_grpc_loopback_gbps": raw},
    }
