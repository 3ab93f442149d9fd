"""Peer bytes at the wire's limit, with same-run baselines (the machine is shared: read
ratios, and run it on a quiet machine).

1. Peer restore: a node that holds none of a checkpoint's files (`--gib` in `--files`
   files, held by one other node) restores them all at once (EnsureLocal, as a reader
   asks) over the bulk stream, next to raw TCP on loopback in the same run: a `sendfile`
   sender from a tmpfs file and a `recv_into` + `pwrite` receiver into tmpfs. Throughput
   and CPU seconds per GiB on each side (the daemons' from /proc, the raw threads' from
   `time.thread_time`).
   `--tls`: the same restore once more with the peer port and bulk stream under mutual
   TLS (self-signed test certificates, as the tests make them), so what TLS costs each
   side shows next to the plaintext stream.
2. Fan-out (`--fanout 8,16,32`): N daemons, one holds a checkpoint (`--fanout-gib`), all
   the others restore it at once. Bytes sent by the busiest node per GiB of the file and
   per restored GiB, and the total time; against one holder serving all in the same run
   (the same N-1 copies fetched straight from the holder over its bulk stream).

    python bench/bench_wire.py [--gib 1.0] [--files 8] [--repeat 3] [--tls]
                               [--fanout 8,16,32] [--out results.json] [--quick]

`--quick` (a smoke: 10 MiB, one repeat, a 3-node fan-out) checks that it runs, never a
figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Daemon, GiB, MiB, free_ports, make_daemon, tmpfs_root  # noqa: E402
from tierckpt.daemon_client import DaemonClient  # noqa: E402
from tierckpt.v1 import common_pb2, peer_pb2  # noqa: E402
from tierckptd.peers.bulk_client import BulkFetcher, BulkTicket  # noqa: E402
from tierckptd.peers.chunk_wire import PeerStub  # noqa: E402
from tierckptd.peers.security import node_client_interceptor  # noqa: E402

from tests.support.certs import make_certs  # noqa: E402
from tests.support.raw_rpc import write_files  # noqa: E402

NS = "bench-wire"
BUFFER = 4 * MiB
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def payload(nbytes: int) -> bytes:
    block = os.urandom(min(nbytes, 16 * MiB)) or b""
    return (block * (nbytes // max(len(block), 1) + 1))[:nbytes]


# ---- raw TCP on loopback --------------------------------------------------------------


def _send(listener: socket.socket, src: str, nbytes: int, cpu: list[float]) -> None:
    conn, _ = listener.accept()
    start = time.thread_time()
    with conn, open(src, "rb") as f:
        conn.sendfile(f, 0, nbytes)
    cpu.append(time.thread_time() - start)


def raw_tcp(nbytes: int, repeat: int) -> dict[str, float]:
    """Best of `repeat`: sendfile from a tmpfs file -> recv_into + pwrite into tmpfs."""
    root = tmpfs_root()
    src = os.path.join(root, f"bench-wire-src-{os.getpid()}")
    dst = os.path.join(root, f"bench-wire-dst-{os.getpid()}")
    with open(src, "wb") as f:
        f.write(payload(nbytes))
    best: dict[str, float] = {}
    try:
        for _ in range(repeat):
            listener = socket.create_server(("127.0.0.1", 0))
            port = listener.getsockname()[1]
            sent_cpu: list[float] = []

            sender = threading.Thread(target=_send, args=(listener, src, nbytes, sent_cpu))
            sender.start()
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            buf = bytearray(BUFFER)
            view = memoryview(buf)
            wall = time.perf_counter()
            cpu = time.thread_time()
            with socket.create_connection(("127.0.0.1", port)) as sock:
                got = 0
                while got < nbytes:
                    n = sock.recv_into(view)
                    if not n:
                        break
                    os.pwrite(fd, view[:n], got)
                    got += n
            recv_cpu = time.thread_time() - cpu
            sender.join()
            wall = time.perf_counter() - wall
            os.close(fd)
            listener.close()
            if not best or wall < best["seconds"]:
                best = {"seconds": wall, "send_cpu": sent_cpu[0], "recv_cpu": recv_cpu}
    finally:
        for path in (src, dst):
            if os.path.exists(path):
                os.unlink(path)
    return best


# ---- daemons ---------------------------------------------------------------------------


def tls_security(directory: Path) -> list[str]:
    """[security] tables for node0 and node1 under mutual TLS (test certificates from
    one self-signed CA, each naming its node) and a shared token."""
    certs = make_certs(directory)
    token = directory / "token"
    token.write_text("dGllcmNrcHQtYmVuY2gtdG9rZW4=")
    token.chmod(0o600)
    return [
        f'[security]\ntls_cert = "{pair.cert}"\ntls_key = "{pair.key}"\n'
        f'tls_ca = "{certs.ca}"\ntoken_file = "{token}"\n'
        for pair in (certs.node_a, certs.node_b)
    ]


def start_cluster(
    n: int,
    *,
    metrics: bool,
    security: list[str] | None = None,
    heal_interval: float = 3600.0,
) -> tuple[list[Daemon], list[int], list[int]]:
    """`n` peered daemons node0.. with no extra copies (node0's saves stay on node0);
    `security`: each node's [security] table (TOML).

    A commit publishes only to the nodes its checkpoint involves; every other node learns
    it by gossip in its heal rounds (`heal_interval`), as in a real cluster."""
    ports = free_ports(2 * n)
    nodes = []
    for i in range(n):
        peers = "".join(
            f'[[peers]]\nid = "node{j}"\naddress = "127.0.0.1:{ports[j]}"\nfailure_domain = "node{j}"\n'
            for j in range(n)
            if j != i
        )
        metrics_table = f'[metrics]\nlisten = "127.0.0.1:{ports[n + i]}"\n' if metrics else ""
        table = security[i] if security else ""
        extra = (
            f"{metrics_table}{table}[replication]\ncopies = 0\n"
            f"heal_interval = {heal_interval}\n{peers}"
        )
        nodes.append(
            make_daemon(
                node_id=f"node{i}", keep_last=None, peer=f"127.0.0.1:{ports[i]}", extra=extra
            )
        )
    try:
        with futures.ThreadPoolExecutor(min(n, 8)) as pool:
            list(pool.map(lambda d: d.start(), nodes))
    except BaseException:
        for d in nodes:
            with contextlib.suppress(Exception):
                d.stop()
        raise
    return nodes, ports[:n], ports[n:]


def save(client: DaemonClient, cid: str, files: dict[str, bytes]) -> None:
    write_files(client, NS, cid, files)
    client.commit_checkpoint(NS, cid, list(files))


def wait_known(clients: list[DaemonClient], cid: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    for c in clients:
        while cid not in {i.checkpoint_id for i in c.list_checkpoints(NS)}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cid} not published everywhere")
            time.sleep(0.05)


def restore_all(client: DaemonClient, cid: str, names: list[str]) -> None:
    with futures.ThreadPoolExecutor(len(names)) as pool:
        list(pool.map(lambda name: client.ensure_local(NS, cid, name), names))


def sent_bytes(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        body = r.read().decode()
    return sum(
        float(v) for v in re.findall(r"^tierckpt_peer_sent_bytes_total\{[^}]*\} (\S+)$", body, re.M)
    )


def peer_restore(nbytes: int, nfiles: int, repeat: int, *, tls: bool = False) -> dict[str, float]:
    """Best of `repeat` restores of a fresh checkpoint each, node1 from node0 (`tls`:
    under mutual TLS)."""
    certs = Path(tempfile.mkdtemp(prefix="tcb-certs"))
    try:
        return _peer_restore(nbytes, nfiles, repeat, tls_security(certs) if tls else None)
    finally:
        shutil.rmtree(certs, ignore_errors=True)


def _peer_restore(
    nbytes: int, nfiles: int, repeat: int, security: list[str] | None
) -> dict[str, float]:
    nodes, _, _ = start_cluster(2, metrics=False, security=security)
    clients = [DaemonClient(d.address, timeout_s=600) for d in nodes]
    try:
        per = nbytes // nfiles
        files = {f"__0_{i}.distcp": payload(per) for i in range(nfiles)}
        best: dict[str, float] = {}
        for r in range(repeat):
            cid = f"step-{r:04d}"
            save(clients[0], cid, files)
            wait_known(clients[1:], cid)
            assert nodes[0].proc is not None and nodes[1].proc is not None
            send0, recv0 = cpu_seconds(nodes[0].proc.pid), cpu_seconds(nodes[1].proc.pid)
            wall = time.perf_counter()
            restore_all(clients[1], cid, list(files))
            wall = time.perf_counter() - wall
            row = {
                "seconds": wall,
                "send_cpu": cpu_seconds(nodes[0].proc.pid) - send0,
                "recv_cpu": cpu_seconds(nodes[1].proc.pid) - recv0,
            }
            if not best or wall < best["seconds"]:
                best = row
        best["bytes"] = per * nfiles
        return best
    finally:
        for c in clients:
            c.close()
        for d in nodes:
            d.stop()


# ---- fan-out ---------------------------------------------------------------------------


def one_holder(peer_port: int, n: int, cid: str, names: list[str], size: int) -> float:
    """Seconds for N-1 receivers to fetch every file straight from node0's bulk stream
    (node0 serves every copy, within its send slots), received into tmpfs."""
    root = tmpfs_root()
    fetcher = BulkFetcher()

    def fetch(i: int, name: str) -> None:
        channel = grpc.intercept_channel(
            grpc.insecure_channel(f"127.0.0.1:{peer_port}"), node_client_interceptor(f"node{i}")
        )
        request = peer_pb2.FetchFileRequest(
            ref=common_pb2.CheckpointRef(namespace=NS, checkpoint_id=cid), file_name=name
        )
        with channel:
            while True:
                try:
                    g = PeerStub(channel).GrantFetch(request, timeout=30)
                    break
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    time.sleep(0.05)  # busy: its slots are taken
        ticket = BulkTicket(g.grant, "127.0.0.1", g.port, NS, cid, name, g.offset, g.length)
        path = os.path.join(root, f"bench-wire-one-{os.getpid()}-{i}-{name}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for offset, data in fetcher.fetch("node0", ticket, 30.0):
                os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
            os.unlink(path)

    jobs = [(i, name) for i in range(1, n) for name in names]
    wall = time.perf_counter()
    with futures.ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda job: fetch(*job), jobs))
    return time.perf_counter() - wall


def fanout(n: int, nbytes: int, nfiles: int) -> dict[str, Any]:
    for attempt in range(3):
        try:
            nodes, peer_ports, metrics_ports = start_cluster(n, metrics=True, heal_interval=1.0)
            break
        except RuntimeError as e:
            # Each daemon's bulk listener binds an ephemeral port, which may be one that
            # free_ports picked for a daemon not started yet: start the cluster again.
            print(f"fan-out {n}: a daemon did not start ({e}); attempt {attempt + 2} of 3")
    else:
        raise RuntimeError(f"fan-out {n}: the cluster did not start in 3 attempts")
    clients = [DaemonClient(d.address, timeout_s=600) for d in nodes]
    try:
        per = max(1, nbytes // nfiles)
        files = {f"__0_{i}.distcp": payload(per) for i in range(nfiles)}
        names = list(files)
        save(clients[0], "fan", files)
        save(clients[0], "solo", files)
        wait_known(clients[1:], "fan")
        wait_known(clients[1:], "solo")

        before = [sent_bytes(p) for p in metrics_ports]
        wall = time.perf_counter()
        with futures.ThreadPoolExecutor(n - 1) as pool:
            list(pool.map(lambda c: restore_all(c, "fan", names), clients[1:]))
        wave = time.perf_counter() - wall
        sent = [sent_bytes(p) - b for p, b in zip(metrics_ports, before, strict=True)]

        before0 = sent_bytes(metrics_ports[0])
        solo = one_holder(peer_ports[0], n, "solo", names, per)
        solo_sent = sent_bytes(metrics_ports[0]) - before0
        file_bytes = per * nfiles
        restored = file_bytes * (n - 1)
        return {
            "nodes": n,
            "wave_s": wave,
            "busiest_per_file_gib": max(sent) / file_bytes,
            "busiest_per_restored_gib": max(sent) / restored,
            "senders": sum(1 for s in sent if s > 0),
            "solo_s": solo,
            "solo_busiest_per_file_gib": solo_sent / file_bytes,
            "solo_busiest_per_restored_gib": solo_sent / restored,
        }
    finally:
        for c in clients:
            c.close()
        with futures.ThreadPoolExecutor(min(n, 8)) as pool:
            list(pool.map(lambda d: d.stop(), nodes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fanout", default="", help="node counts, e.g. 8,16,32 ('' = skip)")
    parser.add_argument("--fanout-gib", type=float, default=0.25)
    parser.add_argument("--fanout-files", type=int, default=2)
    parser.add_argument("--out", default="", help="write the figures as JSON here")
    parser.add_argument("--quick", action="store_true", help="a smoke run at a tiny size")
    parser.add_argument("--tls", action="store_true", help="also the peer restore under mutual TLS")
    args = parser.parse_args()
    if args.quick:
        args.gib, args.files, args.repeat = 0.01, 2, 1
        args.fanout, args.fanout_gib, args.fanout_files = "3", 0.005, 2
    nbytes = int(args.gib * GiB)
    gib = nbytes / GiB

    raw = raw_tcp(nbytes, args.repeat)
    peer = peer_restore(nbytes, args.files, args.repeat)
    tls = peer_restore(nbytes, args.files, args.repeat, tls=True) if args.tls else None
    print(f"\n## peer restore vs raw TCP on loopback ({gib:.3f} GiB, {args.files} files)")
    print(f"{'path':<44} {'seconds':>8} {'GB/s':>7} {'send CPU s/GiB':>15} {'recv CPU s/GiB':>15}")
    rows = [("raw TCP: sendfile -> recv_into + pwrite", raw), ("tierckpt bulk stream", peer)]
    if tls is not None:
        rows.append(("tierckpt bulk stream, mutual TLS", tls))
    for name, row in rows:
        print(
            f"{name:<44} {row['seconds']:>8.3f} {nbytes / row['seconds'] / 1e9:>7.2f} "
            f"{row['send_cpu'] / gib:>15.3f} {row['recv_cpu'] / gib:>15.3f}"
        )
    print(
        f"ratios: throughput {raw['seconds'] / peer['seconds']:.2f}x raw TCP; CPU per GiB "
        f"sender {peer['send_cpu'] / max(raw['send_cpu'], 1e-9):.2f}x, receiver "
        f"{peer['recv_cpu'] / max(raw['recv_cpu'], 1e-9):.2f}x raw TCP"
    )

    record: dict[str, Any] = {
        "gib": gib,
        "files": args.files,
        "raw_tcp": raw,
        "bulk_restore": peer,
        "ratios": {
            "throughput_over_raw": raw["seconds"] / peer["seconds"],
            "send_cpu_over_raw": peer["send_cpu"] / max(raw["send_cpu"], 1e-9),
            "recv_cpu_over_raw": peer["recv_cpu"] / max(raw["recv_cpu"], 1e-9),
        },
        "fanout": [],
    }
    if tls is not None:
        ratios = {
            "throughput_over_plaintext": peer["seconds"] / tls["seconds"],
            "send_cpu_over_plaintext": tls["send_cpu"] / max(peer["send_cpu"], 1e-9),
            "recv_cpu_over_plaintext": tls["recv_cpu"] / max(peer["recv_cpu"], 1e-9),
        }
        record["bulk_restore_tls"] = {**tls, "ratios": ratios}
        print(
            f"TLS: throughput {ratios['throughput_over_plaintext']:.2f}x the plaintext "
            f"stream; CPU per GiB sender {ratios['send_cpu_over_plaintext']:.2f}x, receiver "
            f"{ratios['recv_cpu_over_plaintext']:.2f}x plaintext"
        )
    counts = [int(c) for c in args.fanout.split(",") if c.strip()]
    if counts:
        fan_bytes = int(args.fanout_gib * GiB)
        print(f"\n## fan-out: every node restores the same {fan_bytes / GiB:.3f} GiB at once")
        print(
            f"{'nodes':>5} {'wave s':>8} {'busiest/file GiB':>17} {'busiest/restored':>17} "
            f"{'senders':>8} {'one-holder s':>13} {'its busiest/file':>17}"
        )
        for n in counts:
            r = fanout(n, fan_bytes, args.fanout_files)
            record["fanout"].append(r)
            print(
                f"{r['nodes']:>5} {r['wave_s']:>8.2f} {r['busiest_per_file_gib']:>17.2f} "
                f"{r['busiest_per_restored_gib']:>17.3f} {r['senders']:>8} "
                f"{r['solo_s']:>13.2f} {r['solo_busiest_per_file_gib']:>17.2f}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
