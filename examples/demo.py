"""tierckpt demo: a real 2-rank FSDP2 job checkpointing through a tierckptd it starts.

1. starts tierckptd (memory tier in tmpfs) on a private unix socket;
2. trains a small FSDP2 model with AdamW on 2 gloo ranks, saving every step with
   dcp.save (the last step with dcp.async_save);
3. kill -9s the daemon and restarts it: the committed checkpoints are re-adopted;
4. a fresh 2-rank job restores the newest checkpoint (checkpoint_id=None) and checks
   it bit-exactly; a 1-process job restores it at a different world size;
5. `tierckpt pull` exports it and stock FileSystemReader loads the copy.

Everything runs on embedded defaults: `python examples/demo.py` (or `make demo`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt import TieredStorageReader, TieredStorageWriter
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

NAMESPACE = "demo-run"
STEPS = 5
WORLD = 2


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


def train_job(rank: int, store: str, address: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    model, optim = build(seed=0)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    writer = TieredStorageWriter(NAMESPACE, daemon=address)
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


def restore_job(rank: int, store: str, address: str, expected_path: str) -> None:
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
    started = time.perf_counter()
    dcp.load(
        state, checkpoint_id=None, storage_reader=TieredStorageReader(NAMESPACE, daemon=address)
    )
    elapsed = time.perf_counter() - started
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
    def __init__(self, root: Path) -> None:
        self.root = root
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.memory_dir = tempfile.mkdtemp(prefix="tierckpt-demo-", dir=shm)
        self.address = f"unix://{root / 'tierckptd.sock'}"
        self.config = root / "tierckptd.toml"
        self.config.write_text(
            f'[node]\nid = "demo-node"\n[listen]\nlocal = "{self.address}"\npeer = ""\n'
            f'[memory]\ndir = "{self.memory_dir}"\nbudget = "2GiB"\n'
            "[retention]\nmemory_keep_last = 3\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.root / "tierckptd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierckptd", "--config", str(self.config)],
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"tierckptd exited; log:\n{(self.root / 'tierckptd.log').read_text()}"
                )
            try:
                with grpc.insecure_channel(self.address) as ch:
                    status = (
                        health_pb2_grpc.HealthStub(ch)
                        .Check(health_pb2.HealthCheckRequest(), timeout=1)
                        .status
                    )
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise SystemExit("tierckptd did not become ready")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        shutil.rmtree(self.memory_dir, ignore_errors=True)


def cli(address: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "tierckpt", "--daemon", address, *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="tcdemo"))
    daemon = Daemon(root)
    try:
        print("1. starting tierckptd (memory tier in tmpfs)")
        daemon.start()
        expected = str(root / "expected.pt")
        print(
            f"2. training {STEPS} steps on {WORLD} gloo ranks (FSDP2 + AdamW), checkpointing every step"
        )
        mp.start_processes(
            train_job,
            args=(str(root / "store-a"), daemon.address, expected),
            nprocs=WORLD,
            start_method="spawn",
        )
        print(cli(daemon.address, "ls", NAMESPACE))
        print("3. kill -9 tierckptd, restart it on the same memory tier")
        daemon.kill9()
        daemon.start()
        print(cli(daemon.address, "ls", NAMESPACE))
        print("4. restoring the newest checkpoint")
        mp.start_processes(
            restore_job,
            args=(str(root / "store-b"), daemon.address, expected),
            nprocs=WORLD,
            start_method="spawn",
        )
        restore_single_process(daemon.address, expected)
        print("5. exporting with `tierckpt pull` and loading the copy with stock FileSystemReader")
        dest = root / "pulled"
        print("  " + cli(daemon.address, "pull", NAMESPACE, f"step-{STEPS:06d}", str(dest)).strip())
        shard0 = {k: v for k, v in torch.load(expected).items() if k.startswith("model.")}
        model, _ = build(seed=3)
        state = {"model": model.state_dict()}
        dcp.load(state, storage_reader=FileSystemReader(str(dest)))
        bad = [
            k
            for k, v in shard0.items()
            if not torch.equal(v, state["model"][k.removeprefix("model.")])
        ]
        if bad:
            raise SystemExit(f"pulled checkpoint is NOT bit-exact: {bad[:5]}")
        print("  stock FileSystemReader: model restored bit-exactly from the pulled copy")
        print("demo OK")
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main()
