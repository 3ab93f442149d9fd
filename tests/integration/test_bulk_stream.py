"""The bulk stream (peers/bulk_server.py) through real daemons: restores over it are
bit-exact, a large file comes from every holder at once, and the data connection gives
nothing to anyone without a fresh grant for exactly that file, range and caller. The
sender does not hash what it sends: a corrupt copy's bytes fail where they land, the
fetcher goes on to the next holder and reports the copy (ReportCorrupt), and the holder
drops it only when its own re-hash fails (a forged report costs a re-hash, nothing more).

The attacker is this test process speaking to a daemon's peer port as "b1" (a member,
without mutual TLS: its identity is only what it claims, the strongest position the
peer-attack tests assume) and to its bulk port with raw sockets. Every daemon runs with
a 2 s fetch stall window (TIERCKPTD_TEST_FETCH_STALL), which is also how long its bulk
sends may make no progress.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import struct
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import ChecksumMismatch, TierUnavailable
from tierckpt.v1 import common_pb2, peer_pb2
from tierckptd.config import SecurityConfig
from tierckptd.ops.priority import BACKGROUND_NICE
from tierckptd.peers.bulk_grants import GRANT_TTL, SEND_SLOTS
from tierckptd.peers.bulk_wire import STATUS_NAMES, encode_request
from tierckptd.peers.chunk_wire import PeerStub
from tierckptd.peers.security import node_client_interceptor, peer_channel_factory

from tests.support.certs import make_certs
from tests.support.daemon_process import DaemonProcess
from tests.support.peer_nodes import payload
from tests.support.ports import free_ports
from tests.support.raw_rpc import save_ranks, write_files
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

NS = "bulk"
MIB = 1 << 20
STALL = 2.0
SMALL = "__0_0.distcp"  # 3 MiB + 17: one source at a time
LARGE = "__0_1.distcp"  # 64 MiB + 5: in ranges from every holder (restore.PARALLEL_MIN)
FILES = {SMALL: payload(1, 3 * MIB + 17), LARGE: payload(2, 64 * MIB + 5), ".metadata": b"m" * 99}


@dataclass
class Node:
    daemon: DaemonProcess
    client: DaemonClient
    peer_address: str
    metrics_url: str

    def sent(self, path: str) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            body = r.read().decode()
        m = re.search(rf'^tierckpt_peer_sent_bytes_total{{path="{path}"}} (\S+)$', body, re.M)
        return float(m.group(1)) if m else 0.0


def start_nodes(
    stack: ExitStack,
    n: int,
    *,
    copies: int,
    env: dict[int, dict[str, str]] | None = None,
    listen: dict[int, dict[str, Any]] | None = None,
) -> list[Node]:
    """`n` peered daemons b0..b{n-1}; `env` and `listen` add to node i's environment
    and [listen] table."""
    ports = free_ports(2 * n)
    ids = [f"b{i}" for i in range(n)]
    nodes = []
    for i in range(n):
        config: dict[str, Any] = {
            "node": {"id": ids[i], "failure_domain": f"rack{i}"},
            "listen": {"peer": f"127.0.0.1:{ports[i]}", **(listen or {}).get(i, {})},
            "memory": {"budget": "1GiB"},
            "replication": {"copies": copies, "heal_interval": 3600.0},
            "metrics": {"listen": f"127.0.0.1:{ports[n + i]}"},
            "peers": [
                {"id": ids[j], "address": f"127.0.0.1:{ports[j]}", "failure_domain": f"rack{j}"}
                for j in range(n)
                if j != i
            ],
        }
        daemon = DaemonProcess(config, name=ids[i], start=False)
        stack.callback(daemon.cleanup)
        client = DaemonClient(daemon.address, timeout_s=60)
        stack.callback(client.close)
        nodes.append(
            Node(
                daemon, client, f"127.0.0.1:{ports[i]}", f"http://127.0.0.1:{ports[n + i]}/metrics"
            )
        )
    env = env or {}
    with _environ({"TIERCKPTD_TEST_FETCH_STALL": str(STALL)}):
        with futures.ThreadPoolExecutor(n) as pool:  # side by side: each takes seconds
            list(pool.map(lambda i: nodes[i].daemon.start(), [i for i in range(n) if i not in env]))
        for i, extra in env.items():
            with _environ(extra):
                nodes[i].daemon.start()
    return nodes


@contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def holders(node: Node, cid: str, name: str) -> list[str]:
    f = next(f for f in node.client.get_checkpoint(NS, cid).files if f.name == name)
    return [f.owner_node, *f.replica_nodes]


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[Node]]:
    """Four nodes, two extra copies: each file of b0's save is held by three of them."""
    with ExitStack() as stack:
        nodes = start_nodes(stack, 4, copies=2)
        save_ranks({0: nodes[0].client}, NS, "step-1", {0: FILES})
        wait_until(
            "step-1 REPLICATED",
            lambda: (
                {c.checkpoint_id: c.state for c in nodes[0].client.list_checkpoints(NS)}.get(
                    "step-1"
                )
                == "REPLICATED"
            ),
            60,
        )
        wait_until(
            "every node knows step-1",
            lambda: all(
                "step-1" in {c.checkpoint_id for c in n.client.list_checkpoints(NS)} for n in nodes
            ),
            60,
        )
        yield nodes


def outsider(nodes: list[Node], name: str) -> int:
    """The node that holds no copy of `name` (three of four do)."""
    held = holders(nodes[0], "step-1", name)
    return next(i for i in range(len(nodes)) if f"b{i}" not in held)


def holder(nodes: list[Node], name: str) -> int:
    return int(holders(nodes[0], "step-1", name)[0][1:])


# ---- the attacker's tools ----------------------------------------------------------------


def stub(node: Node, claim: str | None = "b1") -> PeerStub:
    channel = grpc.insecure_channel(node.peer_address)
    if claim is not None:
        channel = grpc.intercept_channel(channel, node_client_interceptor(claim))
    return PeerStub(channel)


def grant(
    node: Node,
    name: str,
    offset: int = 0,
    length: int = 0,
    claim: str | None = "b1",
    background: bool = False,
) -> peer_pb2.BulkGrant:
    request = peer_pb2.FetchFileRequest(
        ref=common_pb2.CheckpointRef(namespace=NS, checkpoint_id="step-1"),
        file_name=name,
        offset=offset,
        length=length,
        background=background,
    )
    answer: peer_pb2.BulkGrant = stub(node, claim).GrantFetch(request, timeout=10)
    return answer


def bulk_request(token: bytes, name: str, offset: int, length: int) -> bytes:
    return encode_request(
        peer_pb2.BulkRequest(
            grant=token,
            ref=common_pb2.CheckpointRef(namespace=NS, checkpoint_id="step-1"),
            file_name=name,
            offset=offset,
            length=length,
        )
    )


def connect(port: int, source: str = "127.0.0.1", rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.settimeout(15)
    sock.connect(("127.0.0.1", port))
    return sock


def read_n(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(min(n - len(out), 1 << 20))
        if not got:
            break
        out += got
    return bytes(out)


def exchange(port: int, raw: bytes, source: str = "127.0.0.1") -> tuple[str, bytes]:
    """Send `raw` on a bulk connection: ("OK", the bytes) or (the refusal, its message)."""
    with connect(port, source) as sock:
        sock.sendall(raw)
        status = read_n(sock, 1)
        if not status:
            return "CLOSED", b""
        if status[0] == 0:
            (length,) = struct.unpack(">Q", read_n(sock, 8))
            return "OK", read_n(sock, length)
        (n,) = struct.unpack(">H", read_n(sock, 2))
        return STATUS_NAMES[status[0]], read_n(sock, n)


# ---- restores over the stream ----------------------------------------------------------


def _roles(nodes: list[Node], checkpoint_id: str, name: str) -> tuple[int, int, Node]:
    """The file's owner and replica (node indexes) and a node holding neither (the reader)."""
    owner, replica = (int(h[1:]) for h in holders(nodes[0], checkpoint_id, name))
    return owner, replica, nodes[next(i for i in range(4) if i not in (owner, replica))]


def test_a_restore_comes_over_the_bulk_stream_bit_exact(cluster: list[Node]) -> None:
    reader = cluster[outsider(cluster, SMALL)]
    before = {i: (n.sent("bulk"), n.sent("grpc")) for i, n in enumerate(cluster)}
    entry = reader.client.ensure_local(NS, "step-1", SMALL)
    assert entry.local_path and Path(entry.local_path).read_bytes() == FILES[SMALL]
    grew = {i: n.sent("bulk") - before[i][0] for i, n in enumerate(cluster)}
    assert sum(grew.values()) == len(FILES[SMALL]), grew  # one holder sent it, over the stream
    assert all(n.sent("grpc") == before[i][1] for i, n in enumerate(cluster))


def test_a_large_file_comes_from_every_holder_at_once(cluster: list[Node]) -> None:
    i = outsider(cluster, LARGE)
    reader = cluster[i]
    before = [n.sent("bulk") for n in cluster]
    entry = reader.client.ensure_local(NS, "step-1", LARGE)
    assert entry.local_path and Path(entry.local_path).read_bytes() == FILES[LARGE]
    grew = {f"b{j}": n.sent("bulk") - before[j] for j, n in enumerate(cluster) if j != i}
    assert sum(grew.values()) == len(FILES[LARGE]), grew
    assert all(sent > len(FILES[LARGE]) / 4 for sent in grew.values()), grew  # a third each


def test_replication_moves_its_bytes_over_the_bulk_stream(cluster: list[Node]) -> None:
    """A save's copies go as offers: each target fetches from the owner's bulk stream
    (`sendfile` there), so no replica byte travels in a gRPC message; every copy lands
    bit-exact and is listed."""
    owner = cluster[1]
    files = {"__0_0.distcp": payload(7, 2 * MIB + 3), ".metadata": b"r" * 77}
    before = [(n.sent("bulk"), n.sent("grpc")) for n in cluster]
    save_ranks({0: owner.client}, NS, "step-offered", {0: files})
    wait_until(
        "step-offered REPLICATED",
        lambda: owner.client.get_checkpoint(NS, "step-offered").state == "REPLICATED",
        60,
    )
    sent = owner.sent("bulk") - before[1][0]
    assert sent == 2 * sum(len(d) for d in files.values()), sent  # copies = 2
    assert all(n.sent("grpc") == before[i][1] for i, n in enumerate(cluster))
    for name, data in files.items():
        replicas = holders(owner, "step-offered", name)[1:]
        assert len(replicas) == 2 and "b1" not in replicas, replicas
        for r in replicas:
            node = cluster[int(r[1:])]
            f = node.client.get_checkpoint(NS, "step-offered").file(name)
            assert f.local_path and Path(f.local_path).read_bytes() == data, (r, name)


def niced_threads(node: Node) -> int:
    """Threads of the node's daemon at nice BACKGROUND_NICE or above (/proc stat field 19)."""
    count = 0
    for task in Path(f"/proc/{node.daemon.pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        count += int(fields[16]) >= BACKGROUND_NICE
    return count


def test_a_replication_copy_is_sent_at_background_priority_a_restore_is_not(
    cluster: list[Node],
) -> None:
    """A replication copy yields the holder's cores to its own saves (ops/priority.py):
    the send of a grant asked as `background` runs on a thread at nice BACKGROUND_NICE; a
    restore's send keeps normal priority. Read while the send is blocked on a receiver
    that reads nothing more (within the stall window)."""
    node = cluster[holder(cluster, LARGE)]
    size = len(FILES[LARGE])
    wait_until("no send running", lambda: _grants_free(node), 10)
    idle = niced_threads(node)
    seen = {}
    for background in (False, True):
        g = grant(node, LARGE, background=background)
        with connect(g.port, rcvbuf=64 << 10) as sock:
            sock.sendall(bulk_request(g.grant, LARGE, 0, size))
            assert read_n(sock, 9)[:1] == b"\0"  # OK: the send runs, and blocks
            seen[background] = niced_threads(node) - idle
        wait_until("the send dropped", lambda: _grants_free(node), 3 * STALL + 5)
    assert seen == {False: 0, True: 1}, seen


def _read_for(sock: socket.socket, size: int, seconds: float) -> bytes:
    """What arrives on `sock` within `seconds` (at most `size` bytes)."""
    out = bytearray()
    until = time.monotonic() + seconds
    while len(out) < size and (left := until - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(1 << 20, size - len(out)))
        except TimeoutError:
            break
        if not chunk:
            break
        out += chunk
    sock.settimeout(15)
    return bytes(out)


def test_a_replication_copy_steps_aside_for_a_save_a_restore_does_not(
    cluster: list[Node],
) -> None:
    """While a save writes on the holder, a restore's send goes at once, whole; a
    replication copy's (a `background` grant) goes a slice (BACKGROUND_SLICE) at a time,
    at most half the stall window apart, so it lands complete and bit-exact, later."""
    node = cluster[holder(cluster, LARGE)]
    size = len(FILES[LARGE])
    wait_until("no send running", lambda: _grants_free(node), 10)
    got = {}
    for background in (False, True):
        cid = f"step-writing-{int(background)}"
        write_files(node.client, NS, cid, {"__0_0.distcp": b"w" * 1000})  # stays WRITING
        try:
            g = grant(node, LARGE, background=background)
            with connect(g.port) as sock:
                sock.sendall(bulk_request(g.grant, LARGE, 0, size))
                assert read_n(sock, 9)[:1] == b"\0"
                early = _read_for(sock, size, 1.5)
                data = early + _read_for(sock, size - len(early), 30)
        finally:
            node.client.abort_checkpoint(NS, cid)
        assert data == FILES[LARGE], background
        got[background] = len(early)
    assert got[False] == size, got  # a restore is never held back
    assert got[True] < size // 2, got  # at most 2 slices and the socket buffers


def test_an_offer_is_received_on_a_background_thread_that_ends_with_it() -> None:
    """The target takes an offered copy on a thread of its own at nice BACKGROUND_NICE
    (its gRPC handler thread, which serves saves next, keeps normal priority). b1's
    first offered piece waits 3 s there (a fault delay); meanwhile one thread of b1 is
    niced, and none once the copy landed, bit-exact."""
    data = payload(11, 200_000)  # fits the socket buffers: the send is not held up
    with ExitStack() as stack:
        b0, b1 = start_nodes(
            stack, 2, copies=1, env={1: {"TIERCKPT_FAULT": "peer.receive.offered:delay=3@1"}}
        )
        assert niced_threads(b1) == 0
        save_ranks({0: b0.client}, NS, "step-niced", {0: {"__0_0.distcp": data}})
        wait_until("b1 taking the offer", lambda: niced_threads(b1) == 1, 10, interval=0.05)
        wait_until(
            "step-niced REPLICATED",
            lambda: b0.client.get_checkpoint(NS, "step-niced").state == "REPLICATED",
            30,
        )
        assert niced_threads(b1) == 0 and niced_threads(b0) == 0
        f = b1.client.get_checkpoint(NS, "step-niced").file("__0_0.distcp")
        assert f.local_path and Path(f.local_path).read_bytes() == data


# ---- the data connection trusts nothing but a fresh grant -----------------------------


def test_a_connection_without_a_valid_grant_gets_nothing(cluster: list[Node]) -> None:
    node = cluster[holder(cluster, SMALL)]
    size = len(FILES[SMALL])
    g = grant(node, SMALL)
    port = g.port
    assert exchange(port, bulk_request(g.grant, SMALL, 0, size)) == ("OK", FILES[SMALL])
    assert exchange(port, b"GET / HTTP/1.1\r\n\r\n")[0] in ("INVALID_ARGUMENT", "CLOSED")
    assert exchange(port, b"TCB1" + struct.pack(">H", 65535))[0] == "INVALID_ARGUMENT"
    for forged in (os.urandom(32), b"", os.urandom(31)):
        code, message = exchange(port, bulk_request(forged, SMALL, 0, size))
        assert code == "PERMISSION_DENIED" and b"unknown, used or expired" in message
    # Nothing sent at all: closed by the server within its header timeout (5 s).
    started = time.monotonic()
    with connect(port) as sock:
        assert read_n(sock, 1) == b""
    assert time.monotonic() - started < 8
    # The control call stays as guarded as every peer call: strangers get no grant.
    for claim in ("mallory", None):
        with pytest.raises(grpc.RpcError) as e:
            grant(node, SMALL, claim=claim)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_grant_is_bound_to_its_file_range_and_caller(cluster: list[Node]) -> None:
    node = cluster[holder(cluster, SMALL)]
    size = len(FILES[SMALL])
    other = LARGE
    for raw in (
        lambda g: bulk_request(g.grant, other, 0, 99),  # another file
        lambda g: bulk_request(g.grant, SMALL, 0, size),  # another range than granted
    ):
        g = grant(node, SMALL, 0, 1 << 20)
        code, message = exchange(g.port, raw(g))
        assert code == "PERMISSION_DENIED" and b"the grant was for" in message, message
        # ...and the grant is gone with that one try.
        assert exchange(g.port, bulk_request(g.grant, SMALL, 0, 1 << 20))[0] == "PERMISSION_DENIED"
    # Another caller: the grant went to 127.0.0.1, this connection comes from 127.0.0.2.
    g = grant(node, SMALL)
    code, message = exchange(g.port, bulk_request(g.grant, SMALL, 0, size), source="127.0.0.2")
    assert code == "PERMISSION_DENIED" and b"was given to 127.0.0.1" in message
    # Ranges outside the file are refused at the grant.
    with pytest.raises(grpc.RpcError) as e:
        grant(node, SMALL, size - 10, 11)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_grant_serves_once_and_expires(cluster: list[Node]) -> None:
    node = cluster[holder(cluster, SMALL)]
    size = len(FILES[SMALL])
    g = grant(node, SMALL, 1 << 20, 4096)
    assert exchange(g.port, bulk_request(g.grant, SMALL, 1 << 20, 4096)) == (
        "OK",
        FILES[SMALL][1 << 20 : (1 << 20) + 4096],
    )
    assert exchange(g.port, bulk_request(g.grant, SMALL, 1 << 20, 4096))[0] == "PERMISSION_DENIED"
    g = grant(node, SMALL)
    assert g.length == size
    time.sleep(GRANT_TTL + 0.5)
    code, message = exchange(g.port, bulk_request(g.grant, SMALL, 0, size))
    assert code == "PERMISSION_DENIED" and b"expired" in message


def test_a_stalled_receiver_is_cut_off_and_its_slot_comes_back(cluster: list[Node]) -> None:
    """Receivers that stop reading: the holder runs at most SEND_SLOTS sends (then it
    answers busy), and drops each within the stall window, so its slots come back."""
    node = cluster[holder(cluster, LARGE)]
    size = len(FILES[LARGE])
    wait_until("no send running", lambda: _grants_free(node), 10)
    stalled = []
    for _ in range(SEND_SLOTS):
        g = grant(node, LARGE)
        sock = connect(g.port, rcvbuf=64 << 10)
        sock.sendall(bulk_request(g.grant, LARGE, 0, size))
        assert read_n(sock, 9)[:1] == b"\0"  # OK, and then it reads no more
        stalled.append(sock)
    with pytest.raises(grpc.RpcError) as e:
        grant(node, SMALL)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in str(e.value.details())
    started = time.monotonic()
    wait_until("a slot free again", lambda: _grants_free(node), 3 * STALL + 5)
    assert time.monotonic() - started < 3 * STALL + 5
    for sock in stalled:
        with sock:
            got = 0
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
            assert got < size  # cut off, never completed


def _grants_free(node: Node) -> bool:
    """Whether the node grants a transfer now (the grant is used at once, so it holds
    no slot)."""
    try:
        g = grant(node, SMALL, 0, 1)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return False
        raise
    assert exchange(g.port, bulk_request(g.grant, SMALL, 0, 1)) == ("OK", FILES[SMALL][:1])
    return True


# ---- a stalled sender, and a peer without the stream ---------------------------------


def test_a_stalled_sender_is_given_up_and_an_old_peer_is_fetched_over_grpc() -> None:
    """b0 freezes after granting (its send waits 8 s before the first byte): b1's
    restore gives up within the stall window. b2 runs no bulk listener (an older node):
    b1 restores its file over FetchFile."""
    with ExitStack() as stack:
        nodes = start_nodes(
            stack,
            3,
            copies=0,
            env={0: {"TIERCKPT_FAULT": "peer.bulk.send:delay=8"}},
            listen={2: {"peer_bulk": False}},
        )
        data = payload(3, 2 * MIB + 1)
        save_ranks({0: nodes[0].client}, NS, "step-1", {0: {SMALL: data}})
        save_ranks({0: nodes[2].client}, "old", "step-1", {0: {SMALL: data}})
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match="no answer for 2 s"):
            nodes[1].client.ensure_local(NS, "step-1", SMALL)
        assert time.monotonic() - started < 4 * STALL + 3
        before = nodes[2].sent("grpc")
        entry = nodes[1].client.ensure_local("old", "step-1", SMALL)
        assert entry.local_path and Path(entry.local_path).read_bytes() == data
        assert nodes[2].sent("grpc") - before == len(data) and nodes[2].sent("bulk") == 0


# ---- under mutual TLS -----------------------------------------------------------------


def test_under_mutual_tls_a_grant_is_bound_to_the_certificate(tmp_path: Path) -> None:
    """The bulk listener speaks TLS with the peer port's certificate and CA: a restore
    over it is bit-exact, and a grant node1 was given serves only a connection whose
    client certificate names node1 (not a stranger's from the same CA, not none)."""
    certs = make_certs(tmp_path)
    token = tmp_path / "token"
    token.write_text("dGllcmNrcHQtdGVzdC10b2tlbg==")
    token.chmod(0o600)
    ports = free_ports(3)
    pairs = [certs.node_a, certs.node_b]
    with ExitStack() as stack:
        nodes = []
        for i in range(2):
            j = 1 - i
            config: dict[str, Any] = {
                "node": {"id": f"node{i}", "failure_domain": f"rack{i}"},
                "listen": {"peer": f"127.0.0.1:{ports[i]}"},
                "replication": {"copies": 0, "heal_interval": 3600.0},
                "security": {
                    "tls_cert": pairs[i].cert,
                    "tls_key": pairs[i].key,
                    "tls_ca": certs.ca,
                    "token_file": str(token),
                },
                "peers": [{"id": f"node{j}", "address": f"127.0.0.1:{ports[j]}"}],
            }
            if i == 0:
                config["metrics"] = {"listen": f"127.0.0.1:{ports[2]}"}
            daemon = DaemonProcess(config, name=f"node{i}", start=False)
            stack.callback(daemon.cleanup)
            nodes.append(daemon)
        with futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda d: d.start(), nodes))
        clients = [DaemonClient(d.address, timeout_s=60) for d in nodes]
        for c in clients:
            stack.callback(c.close)
        data = payload(4, 5 * MIB + 3)
        save_ranks({0: clients[0]}, NS, "step-1", {0: {SMALL: data}})
        wait_until(
            "node1 knows step-1",
            lambda: "step-1" in {c.checkpoint_id for c in clients[1].list_checkpoints(NS)},
            30,
        )
        holder = Node(
            nodes[0], clients[0], f"127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[2]}/metrics"
        )
        before = holder.sent("bulk")
        entry = clients[1].ensure_local(NS, "step-1", SMALL)
        assert entry.local_path and Path(entry.local_path).read_bytes() == data
        assert holder.sent("bulk") - before == len(data)

        as_node1 = SecurityConfig(str(token), certs.node_b.cert, certs.node_b.key, certs.ca)

        def tls_grant() -> peer_pb2.BulkGrant:
            with peer_channel_factory(as_node1)(holder.peer_address) as channel:
                request = peer_pb2.FetchFileRequest(
                    ref=common_pb2.CheckpointRef(namespace=NS, checkpoint_id="step-1"),
                    file_name=SMALL,
                )
                answer: peer_pb2.BulkGrant = PeerStub(channel).GrantFetch(request, timeout=10)
                return answer

        def tls_exchange(port: int, raw: bytes, pair: Any) -> tuple[str, bytes]:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.load_verify_locations(certs.ca)
            if pair is not None:
                ctx.load_cert_chain(pair.cert, pair.key)
            try:
                with ctx.wrap_socket(connect(port), server_hostname="node0") as sock:
                    sock.sendall(raw)
                    status = read_n(sock, 1)
                    if not status:
                        return "CLOSED", b""
                    if status[0] == 0:
                        (length,) = struct.unpack(">Q", read_n(sock, 8))
                        return "OK", read_n(sock, length)
                    (n,) = struct.unpack(">H", read_n(sock, 2))
                    return STATUS_NAMES[status[0]], read_n(sock, n)
            except (ssl.SSLError, ConnectionError):
                return "HANDSHAKE", b""

        g = tls_grant()
        code, message = tls_exchange(
            g.port, bulk_request(g.grant, SMALL, 0, len(data)), certs.stranger
        )
        assert code == "PERMISSION_DENIED" and b"certificate does not name it" in message
        g = tls_grant()
        assert tls_exchange(g.port, bulk_request(g.grant, SMALL, 0, len(data)), None)[0] in (
            "HANDSHAKE",
            "CLOSED",
        )
        g = tls_grant()
        assert tls_exchange(g.port, bulk_request(g.grant, SMALL, 0, len(data)), certs.node_b) == (
            "OK",
            data,
        )


# ---- a corrupt copy: caught where it lands, reported, re-checked by its holder -------


def corrupted(count: str, node: Node) -> float:
    """tierckpt_corrupt_copies_total{where=`count`} on `node`."""
    with urllib.request.urlopen(node.metrics_url, timeout=10) as r:
        body = r.read().decode()
    m = re.search(rf'^tierckpt_corrupt_copies_total{{where="{count}"}} (\S+)$', body, re.M)
    return float(m.group(1)) if m else 0.0


def flip(node: Node, cid: str, name: str, at: int) -> bytes:
    """Flip one byte of `node`'s memory-tier copy; the good bytes."""
    path = node.daemon.data_dir(NS, cid) / name
    good = path.read_bytes()
    path.chmod(0o600)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([good[at] ^ 0x5A]))
    return good


def test_a_corrupt_copy_is_caught_where_it_lands_reported_and_repaired() -> None:
    """The owner's copy has a flipped byte; its bulk send does not hash, so the bytes go
    out, fail the reader's verification, and the reader lands the file bit-exact from the
    other holder. The owner, told, re-hashes its copy, drops it and repairs it. With
    every copy corrupt the restore fails naming the file, and no corrupt copy stays served."""
    with ExitStack() as stack:
        nodes = start_nodes(stack, 4, copies=1)
        data = payload(5, 3 * MIB + 17)
        for cid in ("step-1", "step-2"):
            save_ranks({0: nodes[0].client}, NS, cid, {0: {SMALL: data, ".metadata": b"m" * 9}})
        for cid in ("step-1", "step-2"):
            wait_until(
                f"{cid} held twice and known everywhere",
                lambda cid=cid: (
                    len(holders(nodes[0], cid, SMALL)) == 2
                    and all(
                        cid in {c.checkpoint_id for c in n.client.list_checkpoints(NS)}
                        for n in nodes
                    )
                ),
                60,
            )
        owner, replica, reader = _roles(nodes, "step-1", SMALL)
        good = flip(nodes[owner], "step-1", SMALL, 2 * MIB + 5)
        assert good == data
        sent = [n.sent("bulk") for n in nodes]
        entry = reader.client.ensure_local(NS, "step-1", SMALL)
        assert entry.local_path and Path(entry.local_path).read_bytes() == data
        assert nodes[owner].sent("bulk") > sent[owner]  # it sent its bytes, unhashed...
        # ...the copy came from the other holder (which may serve the owner's repair too).
        assert nodes[replica].sent("bulk") - sent[replica] >= len(data)
        victim = nodes[owner].daemon.data_dir(NS, "step-1") / SMALL
        wait_until(
            "the owner re-checked, dropped and repaired its copy",
            lambda: victim.exists() and victim.read_bytes() == data,
            30,
        )
        assert corrupted("served", nodes[owner]) == 1.0
        log = nodes[owner].daemon.log_path.read_text()
        assert "reports its copy of bulk/step-1/__0_0.distcp from here corrupt" in log
        assert "re-checked after node" in log

        # A large file in ranges from both holders: the replica's range fails where it
        # lands, the reader tells the replica and lands the file from the owner alone.
        big = payload(6, 64 * MIB + 5)
        save_ranks({0: nodes[0].client}, NS, "step-3", {0: {LARGE: big, ".metadata": b"m"}})
        wait_until(
            "step-3 held twice and known everywhere",
            lambda: (
                len(holders(nodes[0], "step-3", LARGE)) == 2
                and all(
                    "step-3" in {c.checkpoint_id for c in n.client.list_checkpoints(NS)}
                    for n in nodes
                )
            ),
            60,
        )
        owner, replica, reader = _roles(nodes, "step-3", LARGE)
        for at in (5, 40 * MIB):  # one flip in each half: whichever range it serves
            flip(nodes[replica], "step-3", LARGE, at)
        entry = reader.client.ensure_local(NS, "step-3", LARGE)
        assert entry.local_path and Path(entry.local_path).read_bytes() == big
        victim = nodes[replica].daemon.data_dir(NS, "step-3") / LARGE
        wait_until(
            "the replica re-checked, dropped and repaired its copy",
            lambda: victim.exists() and victim.read_bytes() == big,
            60,
        )
        assert corrupted("served", nodes[replica]) == 1.0

        # Every copy corrupt: the restore fails clearly; both holders drop theirs.
        owner, replica, reader = _roles(nodes, "step-2", SMALL)
        for i in (owner, replica):
            flip(nodes[i], "step-2", SMALL, 7)
        with pytest.raises(ChecksumMismatch, match=r"__0_0\.distcp"):
            reader.client.ensure_local(NS, "step-2", SMALL)
        wait_until(
            "both holders dropped their corrupt copies",
            lambda: all(
                not (nodes[i].daemon.data_dir(NS, "step-2") / SMALL).exists()
                or (nodes[i].daemon.data_dir(NS, "step-2") / SMALL).read_bytes() == data
                for i in (owner, replica)
            ),
            30,
        )


def report(node: Node, name: str, claim: str | None = "b1") -> peer_pb2.ReportCorruptResponse:
    request = peer_pb2.ReportCorruptRequest(
        ref=common_pb2.CheckpointRef(namespace=NS, checkpoint_id="step-1"), file_name=name
    )
    answer: peer_pb2.ReportCorruptResponse = stub(node, claim).ReportCorrupt(request, timeout=10)
    return answer


def test_a_forged_corrupt_report_costs_a_rehash_never_a_good_copy(cluster: list[Node]) -> None:
    node = cluster[holder(cluster, SMALL)]
    path = node.daemon.data_dir(NS, "step-1") / SMALL
    before = corrupted("served", node)
    assert report(node, SMALL).rechecking  # b1 lies: the copy is good
    wait_until(
        "the re-check is done",
        lambda: (
            "reported bulk/step-1/__0_0.distcp corrupt, but this node's copy verifies"
            in node.daemon.log_path.read_text()
        ),
        10,
    )
    assert not report(node, SMALL).rechecking  # re-checked just now: ignored
    assert corrupted("served", node) == before
    assert path.read_bytes() == FILES[SMALL]
    g = grant(node, SMALL)
    assert exchange(g.port, bulk_request(g.grant, SMALL, 0, len(FILES[SMALL]))) == (
        "OK",
        FILES[SMALL],
    )
    # A file it does not know, a name that is no file name: nothing is re-hashed.
    with pytest.raises(grpc.RpcError) as e:
        report(node, "__9_9.distcp")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        report(node, "../../etc/passwd")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Unauthenticated (no claim) and a stranger's: refused before anything is looked at.
    for claim in (None, "mallory"):
        with pytest.raises(grpc.RpcError) as e:
            report(node, SMALL, claim=claim)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
