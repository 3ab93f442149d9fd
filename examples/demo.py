"""tierckpt demo: a real 2-rank FSDP2 job checkpointing through two tierckptd nodes.

1. starts two daemons on this machine as two nodes ("node-a", "node-b", each its own
   failure domain, memory tier in tmpfs), peering over 127.0.0.1;
2. trains a small FSDP2 model with AdamW on 2 gloo ranks, rank r on node r, saving every
   step with dcp.save (the last step with dcp.async_save); each node replicates its
   ranks' files to the other;
3. kill -9s node-a and restarts it: its memory tier is re-adopted;
4. loses node-b for good (kill -9, memory wiped) and starts an empty replacement with the
   same id: a fresh 2-rank job restores the newest checkpoint bit-exactly, node-b's
   files coming from its buddy; a 1-process job restores it at another world size;
5. `tierckpt pull` exports it and stock FileSystemReader loads the copy;
6. every checkpoint also drains to an embedded S3 (the tests' moto server,
   tests/support/moto_s3.py, on loopback): stock `dcp.load(checkpoint_id="s3://...")`
   reads it without tierckpt;
7. the whole cluster is lost (every daemon killed, every memory tier wiped): fresh daemons
   list the checkpoints from S3 and a 2-rank job restores the newest bit-exactly.

Each restoring rank prints which tier served each file. The reader knows which files its
node already held; for the others, the rank reads its daemon's
`tierckpt_restore_duration_seconds_count{source}` (one count per file EnsureLocal served:
memory, peer, persistent) before and after the load. EnsureLocal's answer does not name the
source, so when one node's fetches came from two tiers the rank prints the files and the
counts per tier rather than guess which file came from where.

Everything runs on embedded defaults: `python examples/demo.py` (or `make demo`, whose
.venv has the dev extra the moto server comes from).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from tierckpt import TieredStorageReader, TieredStorageWriter
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

NAMESPACE = "demo-run"
STEPS = 5
WORLD = 2
NODES = ("node-a", "node-b")  # rank r runs on node r
BUCKET = "demo-checkpoints"
REPO = Path(__file__).resolve().parent.parent  # for tests/support (the moto server)

# The `source` label of the daemon's restore metric, as the demo says it.
TIERS = {
    "memory": "this node's memory",
    "peer": "the peer tier (another node's memory)",
    "persistent": "the persistent tier (S3)",
}


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of model + optimizer as a full (unsharded) CPU tensor, for comparison."""
    msd, osd = get_state_dict(model, optim)
    flat: dict[str, torch.Tensor] = {}
    for k, v in msd.items():
        flat[f"model.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    for k, per_param in osd["state"].items():
        for name, v in per_param.items():
            flat[f"optim.{k}.{name}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return {k: v.detach().clone() for k, v in flat.items()}


def train_job(rank: int, store: str, addresses: tuple[str, ...], out: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    model, optim = build(seed=0)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    writer = TieredStorageWriter(NAMESPACE, daemon=addresses[rank])  # this rank's node
    pending = None
    for step in range(1, STEPS + 1):
        loss = model(torch.randn(32, 512, generator=gen)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        msd, osd = get_state_dict(model, optim)
        state: dict[str, Any] = {
            "model": msd,
            "optim": osd,
            f"dataloader.rank_{rank}": {"step": step, "rank": rank},
        }
        started = time.perf_counter()
        if step < STEPS:
            dcp.save(state, checkpoint_id=f"step-{step:06d}", storage_writer=writer)
            what = "dcp.save"
        else:
            pending = dcp.async_save(state, checkpoint_id=f"step-{step:06d}", storage_writer=writer)
            what = "dcp.async_save (blocking part)"
        if rank == 0:
            print(
                f"  step {step}: loss {loss.item():.4f}, {what} {1000 * (time.perf_counter() - started):.1f} ms",
                flush=True,
            )
    if pending is not None:
        pending.result()
    expected = full_state(model, optim)
    if rank == 0:
        torch.save(expected, out)
    dist.destroy_process_group()


def metric_counts(metrics_url: str, sample_name: str, label: str) -> dict[str, int]:
    """One counter of a daemon's /metrics, by the value of one label."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels[label]: int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == sample_name
    }


def restores_by_tier(metrics_url: str) -> dict[str, int]:
    """Files a daemon's EnsureLocal has served so far, by the tier each came from."""
    return metric_counts(metrics_url, "tierckpt_restore_duration_seconds_count", "source")


def served_by(
    sources: dict[str, str], before: dict[str, int], after: dict[str, int]
) -> list[tuple[str, list[str]]]:
    """(where, files) for one rank's load: the files its node held, and the fetched ones
    by tier when the daemon's counters leave one answer (else the counts per tier)."""
    held = sorted(n for n, s in sources.items() if s == "memory")
    fetched = sorted(n for n, s in sources.items() if s != "memory")
    served = {t: after.get(t, 0) - before.get(t, 0) for t in TIERS}
    served = {t: n for t, n in served.items() if n > 0}
    out = [(TIERS["memory"], held)] if held else []
    if not fetched:
        return out
    if len(served) == 1 and sum(served.values()) == len(fetched):
        (tier,) = served
        return [*out, (f"fetched from {TIERS[tier]}", fetched)]
    counts = " and ".join(f"{n} from {TIERS[t]}" for t, n in served.items()) or "no count"
    return [
        *out,
        (f"fetched by tierckptd, {counts}; which file came from which is not reported", fetched),
    ]


def restore_job(
    rank: int,
    store: str,
    addresses: tuple[str, ...],
    metrics_urls: tuple[str, ...],
    expected_path: str,
) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    model, optim = build(seed=1)  # different weights: the load must overwrite every byte
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 512)).sum().backward()
    optim.step()  # materialize optimizer state to load into
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {
        "model": msd,
        "optim": osd,
        f"dataloader.rank_{rank}": {"step": -1, "rank": -1},
    }
    reader = TieredStorageReader(NAMESPACE, daemon=addresses[rank])
    before = restores_by_tier(metrics_urls[rank])
    started = time.perf_counter()
    dcp.load(state, checkpoint_id=None, storage_reader=reader)
    elapsed = time.perf_counter() - started
    after = restores_by_tier(metrics_urls[rank])
    served = "; ".join(
        f"{where}: {', '.join(files)}" for where, files in served_by(reader.sources, before, after)
    )
    print(f"  rank {rank} on {NODES[rank]}: {served}", flush=True)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_state(model, optim)
    expected = torch.load(expected_path)
    bad = [k for k in expected if not torch.equal(expected[k], got[k])]
    loader = state[f"dataloader.rank_{rank}"]
    if bad or loader != {"step": STEPS, "rank": rank}:
        raise SystemExit(f"rank {rank}: restore is NOT bit-exact: {bad[:5]} {loader}")
    if rank == 0:
        print(
            f"  world {WORLD}: newest checkpoint restored bit-exactly in {1000 * elapsed:.1f} ms",
            flush=True,
        )
    dist.destroy_process_group()


def restore_single_process(address: str, expected_path: str) -> None:
    """World size 2 -> 1: DCP reshards; the reader serves any byte range of any rank's file."""
    model, optim = build(seed=2)
    model(torch.randn(2, 512)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    started = time.perf_counter()
    dcp.load(
        state,
        checkpoint_id=f"step-{STEPS:06d}",
        storage_reader=TieredStorageReader(NAMESPACE, daemon=address),
    )
    elapsed = time.perf_counter() - started
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got, expected = full_state(model, optim), torch.load(expected_path)
    bad = [k for k in expected if not torch.equal(expected[k], got[k])]
    if bad:
        raise SystemExit(f"resharded restore is NOT bit-exact: {bad[:5]}")
    print(
        f"  world 1 (resharded from 2): restored bit-exactly in {1000 * elapsed:.1f} ms", flush=True
    )


class Daemon:
    """One node's tierckptd: its own socket, memory tier in tmpfs, and a peer port."""

    def __init__(
        self,
        root: Path,
        node: str,
        ports: tuple[int, int],
        peers: dict[str, int],
        s3_endpoint: str,
    ) -> None:
        self.root = root
        self.node = node
        peer_port, metrics_port = ports
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.memory_dir = tempfile.mkdtemp(prefix=f"tierckpt-demo-{node}-", dir=shm)
        self.address = f"unix://{root / f'{node}.sock'}"
        self.config = root / f"{node}.toml"
        self.log = root / f"{node}.log"
        peer_tables = "".join(
            f'[[peers]]\nid = "{p}"\naddress = "127.0.0.1:{port}"\nfailure_domain = "{p}"\n'
            for p, port in peers.items()
        )
        self.config.write_text(
            f'[node]\nid = "{node}"\nfailure_domain = "{node}"\n'
            f'[listen]\nlocal = "{self.address}"\npeer = "127.0.0.1:{peer_port}"\n'
            f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n'
            f'[memory]\ndir = "{self.memory_dir}"\nbudget = "2GiB"\n'
            "[retention]\nmemory_keep_last = 3\n"
            "[replication]\ncopies = 1\nheal_interval = 15.0\n"
            f'[persistent]\nurl = "s3://{BUCKET}"\nevery = 1\ncompression = "zstd"\n'
            f'storage_options = {{ endpoint_url = "{s3_endpoint}" }}\n' + peer_tables
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start and wait until SERVING; returns the seconds it took."""
        started = time.perf_counter()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierckptd", "--config", str(self.config)],
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"tierckptd {self.node} exited; log:\n{self.log.read_text()}")
            try:
                with grpc.insecure_channel(self.address) as ch:
                    status = (
                        health_pb2_grpc.HealthStub(ch)
                        .Check(health_pb2.HealthCheckRequest(), timeout=1)
                        .status
                    )
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return time.perf_counter() - started
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"tierckptd {self.node} did not become ready")

    def kill9(self, *, wipe_memory: bool = False) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if wipe_memory:  # the node died with its RAM
            shutil.rmtree(self.memory_dir, ignore_errors=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        shutil.rmtree(self.memory_dir, ignore_errors=True)


def start_embedded_s3() -> Any:
    """The tests' moto server (tests/support/moto_s3.py) on loopback, in this process, as
    the demo's persistent tier, with a bucket; every S3 client of this process and of the
    daemons and ranks it starts is pointed at it."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import s3fs

    from tests.support.moto_s3 import AWS_UNSET, MotoServer, aws_environment

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = MotoServer()
    for name in AWS_UNSET:
        os.environ.pop(name, None)
    os.environ.update(aws_environment(server.endpoint_url))  # stock DCP's s3:// reader too
    s3fs.S3FileSystem(endpoint_url=server.endpoint_url).mkdir(BUCKET)
    return server


def wait_state(address: str, checkpoint_id: str, state: str, timeout: float = 120.0) -> float:
    """Until `ls` on `address` shows the checkpoint in `state`; "REPLICATED" also accepts a
    DURABLE checkpoint whose files all have their peer copies (durability ranks higher)."""

    def reached(row: dict[str, Any]) -> bool:
        if row["state"] == state:
            return True
        tiers = set(row["tiers"])
        return (
            state == "REPLICATED"
            and row["state"] == "DURABLE"
            and "peer" in tiers
            and not (tiers & {"under-replicated", "lost"})
        )

    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        rows = json.loads(cli(address, "ls", NAMESPACE, "--json"))
        if any(r["id"] == checkpoint_id and reached(r) for r in rows):
            return time.perf_counter() - started
        time.sleep(0.2)
    raise SystemExit(f"{checkpoint_id} did not become {state}:\n{cli(address, 'ls', NAMESPACE)}")


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def cli(address: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "tierckpt", "--daemon", address, *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="tcdemo"))
    free = free_ports(2 * len(NODES))
    ports = {n: (free[2 * i], free[2 * i + 1]) for i, n in enumerate(NODES)}
    s3 = start_embedded_s3()
    nodes = [
        Daemon(root, n, ports[n], {p: ports[p][0] for p in NODES if p != n}, s3.endpoint_url)
        for n in NODES
    ]
    addresses = tuple(d.address for d in nodes)
    metrics_urls = tuple(d.metrics_url for d in nodes)
    node_a, node_b = nodes
    newest = f"step-{STEPS:06d}"
    try:
        print("1. starting tierckptd on two nodes (memory tier in tmpfs, peers on 127.0.0.1)")
        for d in nodes:
            d.start()
        expected = str(root / "expected.pt")
        print(
            f"2. training {STEPS} steps on {WORLD} gloo ranks (FSDP2 + AdamW), rank r on node r, "
            "checkpointing every step"
        )
        mp.start_processes(
            train_job,
            args=(str(root / "store-a"), addresses, expected),
            nprocs=WORLD,
            start_method="spawn",
        )
        took = wait_state(node_a.address, newest, "REPLICATED")
        print(
            f"  {newest} REPLICATED {1000 * took:.0f} ms after the job ended; `tierckpt ls` on node-b:"
        )
        print(cli(node_b.address, "ls", NAMESPACE))
        print("3. kill -9 node-a's daemon and restart it on the same memory tier")
        node_a.kill9()
        print(f"  node-a back in {node_a.start():.2f} s, memory tier re-adopted:")
        print(cli(node_a.address, "ls", NAMESPACE))
        print("4. node-b is lost with its memory; an empty replacement takes its id")
        node_b.kill9(wipe_memory=True)
        print(
            f"  replacement node-b ready in {node_b.start():.2f} s (manifests pulled from node-a)"
        )
        mp.start_processes(
            restore_job,
            args=(str(root / "store-b"), addresses, metrics_urls, expected),
            nprocs=WORLD,
            start_method="spawn",
        )
        restore_single_process(node_a.address, expected)
        took = wait_state(node_b.address, newest, "REPLICATED")
        print(f"  healing: every file has its extra copy again {took:.1f} s later")
        pushed = metric_counts(node_b.metrics_url, "tierckpt_peer_requests_total", "method")
        print(
            f"  the replacement node-b took {pushed.get('PushFile', 0)} files pushed by node-a's "
            "healer (peer tier) since it started"
        )
        print("5. exporting with `tierckpt pull` and loading the copy with stock FileSystemReader")
        dest = root / "pulled"
        print("  " + cli(node_a.address, "pull", NAMESPACE, newest, str(dest)).strip())
        full = {k: v for k, v in torch.load(expected).items() if k.startswith("model.")}
        model, _ = build(seed=3)
        state = {"model": model.state_dict()}
        dcp.load(state, storage_reader=FileSystemReader(str(dest)))
        bad = [
            k
            for k, v in full.items()
            if not torch.equal(v, state["model"][k.removeprefix("model.")])
        ]
        if bad:
            raise SystemExit(f"pulled checkpoint is NOT bit-exact: {bad[:5]}")
        print("  stock FileSystemReader: model restored bit-exactly from the pulled copy")
        print("6. every checkpoint drains to the embedded S3 (moto) in the background")
        took = wait_state(node_a.address, newest, "DURABLE")
        print(f"  {newest} DURABLE ({took:.1f} s after we started waiting)")
        state = {"model": build(seed=4)[0].state_dict()}
        dcp.load(state, checkpoint_id=f"s3://{BUCKET}/{NAMESPACE}/{newest}")  # stock DCP only
        bad = [
            k
            for k, v in full.items()
            if not torch.equal(v, state["model"][k.removeprefix("model.")])
        ]
        if bad:
            raise SystemExit(f"stock dcp.load from S3 is NOT bit-exact: {bad[:5]}")
        print("  stock dcp.load(checkpoint_id='s3://...') restored the model bit-exactly")
        print("7. the whole cluster is lost: every daemon killed, every memory tier wiped")
        for d in nodes:
            d.kill9(wipe_memory=True)
        for d in nodes:
            d.start()
        print(cli(node_a.address, "ls", NAMESPACE))
        mp.start_processes(
            restore_job,
            args=(str(root / "store-c"), addresses, metrics_urls, expected),
            nprocs=WORLD,
            start_method="spawn",
        )
        print("demo OK")
    finally:
        for d in nodes:
            d.stop()
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main()
