"""Peer-tier benchmark, with same-run baselines (the machine is shared: read ratios).

1. Restore throughput from a peer (DaemonService.EnsureLocal of every data file on a
   replacement node) next to raw grpcio streaming and raw TCP (`sendfile` ->
   `recv_into` + `pwrite`, as bench_wire.py) of the same number of bytes on loopback.
2. Replacement-node recovery: `dcp.load` on a node whose memory was wiped (files come
   from its buddy) next to `dcp.load` from the local memory tier, right after the
   replacement reports READY; and the seconds from READY until every file is back with
   no reader asking (the replacement's start announce makes its buddy offer them back:
   the replacement fetches them over the buddy's bulk stream).
   Each is the best of `--repeat` fresh replacements.
3. `dcp.save` with replication on (2 nodes, copies = 1) and off (1 node): saves back to
   back (each next save while the previous one's copies are pushed: the buddy's receiver
   shares this machine's cores) and saves spaced as in training (2 s apart, and with
   replication the previous save REPLICATED first).

    python bench/bench_peer_tier.py [--gib 1.0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    Daemon,
    GiB,
    MiB,
    Table,
    best_of,
    daemon,
    free_ports,
    make_daemon,
)
from bench_wire import raw_tcp  # noqa: E402
from tierckpt import TieredStorageReader, TieredStorageWriter  # noqa: E402
from tierckpt.daemon_client import DaemonClient  # noqa: E402

NS = "bench-peer"
CHUNK = 1 * MiB


def raw_grpc_stream(nbytes: int) -> float:
    """Seconds to stream `nbytes` in 1 MiB messages over loopback TCP with plain grpcio."""
    payload = memoryview(bytearray(torch.randn(CHUNK // 4).numpy().tobytes()))

    def stream(request: bytes, context: Any) -> Any:
        for _ in range(nbytes // CHUNK):
            yield bytes(payload)  # one copy into the message, as a file server makes

    handler = grpc.method_handlers_generic_handler(
        "bench.Stream", {"Get": grpc.unary_stream_rpc_method_handler(stream)}
    )
    options = [
        ("grpc.max_send_message_length", 64 * MiB),
        ("grpc.max_receive_message_length", 64 * MiB),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_stream("/bench.Stream/Get")
            sink = bytearray(CHUNK)

            def run() -> None:
                for message in call(b""):
                    sink[: len(message)] = message  # land the bytes, as a fetch does

            return best_of(run, 3)
    finally:
        server.stop(0)


def cluster(n: int) -> list[Daemon]:
    ports = free_ports(n)
    nodes = []
    for i in range(n):
        peers = "".join(
            f'[[peers]]\nid = "node{j}"\naddress = "127.0.0.1:{ports[j]}"\nfailure_domain = "node{j}"\n'
            for j in range(n)
            if j != i
        )
        extra = f"[replication]\ncopies = 1\nheal_interval = 3600.0\n{peers}"
        nodes.append(
            make_daemon(node_id=f"node{i}", keep_last=2, peer=f"127.0.0.1:{ports[i]}", extra=extra)
        )
    for node in nodes:
        node.start()
    return nodes


def wait_state(address: str, checkpoint_id: str, state: str, timeout: float = 120.0) -> None:
    client = DaemonClient(address)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = {c.checkpoint_id: c.state for c in client.list_checkpoints(NS)}
        if rows.get(checkpoint_id) == state:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{checkpoint_id} did not become {state}")


def make_state(nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        f"w{i}": torch.randn(64 * MiB // 4, generator=g)
        for i in range(max(1, nbytes // (64 * MiB)))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    nbytes = int(args.gib * GiB)
    state = make_state(nbytes)
    table = Table("peer tier, 1 rank", nbytes)
    table.add("raw grpcio stream on loopback (1 MiB messages)", raw_grpc_stream(nbytes))
    table.add(
        "raw TCP on loopback (sendfile -> recv_into + pwrite)",
        raw_tcp(nbytes, args.repeat)["seconds"],
    )

    counter = iter(range(1_000_000))

    def save_to(address: str) -> str:
        checkpoint_id = f"step-{next(counter):06d}"
        dcp.save(
            state,
            checkpoint_id=checkpoint_id,
            storage_writer=TieredStorageWriter(NS, daemon=address),
        )
        return checkpoint_id

    with daemon(keep_last=2) as single:
        save_to(single.address)  # warm the pool
        table.add(
            "dcp.save, replication off (1 node)",
            best_of(lambda: save_to(single.address), args.repeat),
        )
        # Spaced as the replicated ones below: the previous save's background work
        # (retention, the next-save prewarm) done first.
        table.add(
            "dcp.save, replication off, spaced (2 s apart)",
            best_of(lambda: save_to(single.address), args.repeat, setup=lambda: time.sleep(2.0)),
        )

    nodes = cluster(2)
    try:
        a, b = nodes
        save_to(a.address)
        table.add(
            "dcp.save, replication on (2 nodes, copies=1)",
            best_of(lambda: save_to(a.address), args.repeat),
        )
        spaced: list[float] = []
        previous = save_to(a.address)
        for _ in range(args.repeat):
            wait_state(a.address, previous, "REPLICATED")  # not timed: training runs
            time.sleep(2.0)  # as the spaced saves without replication
            started = time.perf_counter()
            previous = save_to(a.address)
            spaced.append(time.perf_counter() - started)
        table.add("dcp.save, replication on, spaced (previous one REPLICATED)", min(spaced))
        checkpoint_id = f"step-{next(counter):06d}"
        dcp.save(
            state,
            checkpoint_id=checkpoint_id,
            storage_writer=TieredStorageWriter(NS, daemon=a.address),
        )
        wait_state(a.address, checkpoint_id, "REPLICATED")

        target = {k: torch.zeros_like(v) for k, v in state.items()}
        table.add(
            "dcp.load from the local memory tier",
            best_of(
                lambda: dcp.load(
                    target,
                    checkpoint_id=checkpoint_id,
                    storage_reader=TieredStorageReader(NS, daemon=a.address),
                ),
                args.repeat,
            ),
        )

        def replacement() -> tuple[DaemonClient, list[str], int]:
            """kill -9 node a, wipe its memory and start an empty replacement: (its client,
            the data files, their bytes)."""
            a.kill9_and_wipe()
            a.start()
            client = DaemonClient(a.address)
            info = client.get_checkpoint(NS, checkpoint_id)
            data = [f.name for f in info.files if f.name.endswith(".distcp")]
            size = sum(f.size for f in info.files if f.name in data)
            return client, data, size

        # Restore throughput: EnsureLocal of every data file on an empty replacement,
        # best of `repeat` replacements (as the baseline is best of its runs).
        def restore_once() -> float:
            client, data, fetched = replacement()
            started = time.perf_counter()
            with futures.ThreadPoolExecutor(4) as pool:  # as the reader: all missing files
                list(pool.map(lambda name: client.ensure_local(NS, checkpoint_id, name), data))
            seconds = time.perf_counter() - started
            return seconds * nbytes / max(1, fetched)

        table.add(
            "peer restore, right after READY",
            min(restore_once() for _ in range(args.repeat)),
        )

        # The buddy pushes a replacement's files back on its start announce: seconds from
        # READY until every data file is held there again, no reader asking.
        def pushed_back_once() -> float:
            started = time.perf_counter()
            client, data, fetched = replacement()
            ready = time.perf_counter()
            deadline = ready + 120.0
            while time.perf_counter() < deadline:
                info = client.get_checkpoint(NS, checkpoint_id)
                held = {f.name for f in info.files if f.local_path}
                if held >= set(data):
                    return (time.perf_counter() - ready) * nbytes / max(1, fetched)
                time.sleep(0.01)
            raise TimeoutError(f"files not back {time.perf_counter() - started:.0f} s on")

        table.add(
            "replacement node: every file pushed back after READY",
            min(pushed_back_once() for _ in range(args.repeat)),
        )

        # Recovery time: dcp.load on a fresh replacement (fetches included), bit-exact.
        def recover_once() -> float:
            replacement()
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            started = time.perf_counter()
            dcp.load(
                target,
                checkpoint_id=checkpoint_id,
                storage_reader=TieredStorageReader(NS, daemon=a.address),
            )
            seconds = time.perf_counter() - started
            if any(not torch.equal(target[k], v) for k, v in state.items()):
                raise AssertionError("peer restore is not bit-exact")
            return seconds

        table.add(
            "replacement node: dcp.load right after READY",
            min(recover_once() for _ in range(args.repeat)),
        )
    finally:
        for node in nodes:
            node.stop()

    print(
        table.render(
            [
                (
                    "files pushed back after READY vs raw grpcio stream",
                    "replacement node: every file pushed back after READY",
                    "raw grpcio stream on loopback (1 MiB messages)",
                ),
                (
                    "files pushed back after READY vs raw TCP",
                    "replacement node: every file pushed back after READY",
                    "raw TCP on loopback (sendfile -> recv_into + pwrite)",
                ),
                (
                    "peer restore right after READY vs raw TCP",
                    "peer restore, right after READY",
                    "raw TCP on loopback (sendfile -> recv_into + pwrite)",
                ),
                (
                    "peer restore right after READY vs raw grpcio stream",
                    "peer restore, right after READY",
                    "raw grpcio stream on loopback (1 MiB messages)",
                ),
                (
                    "save with replication on vs off, back to back (goal >= 0.9)",
                    "dcp.save, replication on (2 nodes, copies=1)",
                    "dcp.save, replication off (1 node)",
                ),
                (
                    "save with replication on vs off, spaced (goal >= 0.9)",
                    "dcp.save, replication on, spaced (previous one REPLICATED)",
                    "dcp.save, replication off, spaced (2 s apart)",
                ),
                (
                    "replacement-node load right after READY vs local load",
                    "replacement node: dcp.load right after READY",
                    "dcp.load from the local memory tier",
                ),
            ]
        )
    )


if __name__ == "__main__":
    main()
