"""Persistent-tier benchmark against a moto S3 server (a subprocess on loopback), with
same-run baselines (the machine is shared: read ratios).

1. Drain throughput (commit -> DURABLE, compression none) next to a raw s3fs upload of
   the same files to the same server.
2. zstd ratio and speed on real model + AdamW state (DCP items compressed as the drain
   does, stream.zstd/1).
3. `dcp.save` while a drain is in flight next to a save on an idle daemon.

    python bench/bench_persistent_tier.py [--gib 1.0]
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import GiB, MiB, Table, best_of, make_daemon, tmpfs_root  # noqa: E402
from tierckpt import TieredStorageWriter  # noqa: E402
from tierckpt.daemon_client import DaemonClient  # noqa: E402

NS = "bench-s3"
BUCKET = "bench"


# The tests' moto server (tests/support/moto_s3.py), run in a process of its own: the
# bench's S3 clients (the raw put baseline, goodput's read-back) must not share its GIL.
_SERVE_MOTO = """
import logging, threading
from tests.support.moto_s3 import MotoServer
logging.getLogger("werkzeug").setLevel(logging.WARNING)
print(MotoServer().port, flush=True)
threading.Event().wait()
"""


def start_moto() -> tuple[subprocess.Popen[str], str]:
    """A moto S3 server on loopback in a child process, and its endpoint URL."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE_MOTO],
        cwd=Path(__file__).resolve().parent.parent,  # the repository: `tests` imports
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    port = proc.stdout.readline().strip() if ready else ""
    if not port.isdigit():
        proc.kill()
        raise TimeoutError("moto server did not start")
    return proc, f"http://127.0.0.1:{port}"


def wait_durable(address: str, checkpoint_id: str, timeout: float = 300.0) -> float:
    client = DaemonClient(address)
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        states = {c.checkpoint_id: c.state for c in client.list_checkpoints(NS)}
        if states.get(checkpoint_id) == "DURABLE":
            return time.perf_counter() - started
        time.sleep(0.01)
    raise TimeoutError(f"{checkpoint_id} did not become DURABLE")


def zstd_on_training_state(table: Table) -> str:
    """Compress a real DCP checkpoint of model + AdamW state item by item, as the drain does."""
    from tierckpt.checksum import checksum_bytes
    from tierckpt.memory_files import VerifiedFile
    from tierckptd.persistent.format import compress_items, data_files

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(16, 1024)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    with tempfile.TemporaryDirectory(dir=tmpfs_root()) as d:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(d))
        meta = Path(d, ".metadata").read_bytes()
        raw = packed = 0
        started = time.perf_counter()
        for name, df in data_files(meta).items():
            data = Path(d, name).read_bytes()
            path = str(Path(d, name))
            with (
                VerifiedFile(path, len(data), checksum_bytes(data), what=name) as vf,
                tempfile.TemporaryFile(dir=d) as out,
            ):
                compress_items(vf, list(df.items), out, level=3)
                packed += out.tell()
            raw += len(data)
        seconds = time.perf_counter() - started
    return (
        f"zstd level 3 on model + AdamW state ({raw / MiB:.0f} MiB): compressed to "
        f"{100 * packed / raw:.1f}% at {raw / seconds / 1e9:.2f} GB/s (one core)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    args = parser.parse_args()
    nbytes = int(args.gib * GiB)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    moto, endpoint = start_moto()
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    fs.mkdir(BUCKET)
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(64 * MiB // 4, generator=g) for i in range(nbytes // (64 * MiB))}
    table = Table("persistent tier, 1 rank", nbytes)
    extra = (
        f'[persistent]\nurl = "s3://{BUCKET}"\ncompression = "none"\nevery = 1\n'
        f'storage_options = {{ endpoint_url = "{endpoint}" }}\n'
    )
    d = make_daemon(keep_last=2, extra=extra).start()
    try:
        ids = iter(f"step-{i:06d}" for i in range(1000))
        first = next(ids)
        dcp.save(
            state, checkpoint_id=first, storage_writer=TieredStorageWriter(NS, daemon=d.address)
        )
        wait_durable(d.address, first)

        def save(cid: str) -> float:
            started = time.perf_counter()
            dcp.save(
                state, checkpoint_id=cid, storage_writer=TieredStorageWriter(NS, daemon=d.address)
            )
            return time.perf_counter() - started

        idle, busy, drains = [], [], []
        for _ in range(2):
            cid = next(ids)
            idle.append(save(cid))  # the daemon is idle: the previous drain finished
            drains.append(wait_durable(d.address, cid))
            cid, later = next(ids), next(ids)
            save(cid)
            busy.append(save(later))  # cid is draining meanwhile
            wait_durable(d.address, cid)
            wait_durable(d.address, later)
        table.add("dcp.save on an idle daemon", min(idle))
        table.add("dcp.save while the previous checkpoint drains", min(busy))
        table.add("drain: commit -> DURABLE (compression none)", min(drains))

        info = DaemonClient(d.address).get_checkpoint(NS, cid)
        files = [(f.local_path, f.size) for f in info.files]

        def raw_put() -> None:
            for i, (path, _) in enumerate(files):
                fs.put_file(path, f"{BUCKET}/raw/{i}")

        table.add("raw s3fs put_file of the same files", best_of(raw_put, 2))
    finally:
        d.stop()
        moto.terminate()
        moto.wait(10)
    print(
        table.render(
            [
                (
                    "drain vs raw s3fs put (goal >= 0.8)",
                    "drain: commit -> DURABLE (compression none)",
                    "raw s3fs put_file of the same files",
                ),
                (
                    "idle save vs save with a drain in flight (goal >= 1/1.2 = 0.83)",
                    "dcp.save while the previous checkpoint drains",
                    "dcp.save on an idle daemon",
                ),
            ]
        )
    )
    print(zstd_on_training_state(table))


if __name__ == "__main__":
    main()
