"""A slow link (audit 3, L1): a restore of a 12 MiB file from a peer whose link carries
bytes slowly succeeds when the link keeps up with the fetch's stall window, and otherwise
fails saying "too slow" with the bytes that came, never "no data" while bytes flowed.

The link is a TCP relay between the two real daemons that forwards the holder's answers
at a fixed byte rate (no netem here; the daemons speak plain gRPC through it). The
fetcher's stall window is shortened by the daemon's test hook so the test stays short.

Both ways a file's bytes travel go over the slow link: gRPC FetchFile (the holder's bulk
listener off), whose progress is a whole message (1 MiB), and the granted bulk stream
(GrantFetch), whose progress is any byte. For the bulk stream the holder listens on
127.0.0.2 and the relay takes its bulk port on 127.0.0.1, where the fetcher connects
(the host of the holder's peer address, the port of the grant).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import TierUnavailable
from tierckpt.memory_files import ChecksummingWriter

from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_ports

pytestmark = pytest.mark.integration

NS = "slowlink"
SIZE = 12 << 20
STALL = 2.0  # seconds without a message before the fetcher gives up (test hook)


class SlowRelay:
    """Forwards TCP connections on `port` to `target` (on `target_host`); the answers
    (target -> client) at `rate` bytes per second, the requests as they come. With
    `quiet_after`, each connection's answers stop after that many bytes (a congested
    link: the bytes came, then nothing), the connection left open."""

    def __init__(
        self,
        target: int,
        rate: float,
        *,
        port: int = 0,
        target_host: str = "127.0.0.1",
        quiet_after: int = 0,
    ) -> None:
        self.rate = rate
        self.quiet_after = quiet_after
        self._target = target
        self._target_host = target_host
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", port))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                server = socket.create_connection((self._target_host, self._target))
            except OSError:  # the holder is not listening yet
                client.close()
                continue
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(
                target=self._pump, args=(server, client, self.rate), daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, rate: float) -> None:
        started, sent = time.monotonic(), 0
        try:
            while not self._stop.is_set():
                data = src.recv(16 << 10)
                if not data:
                    break
                if rate and self.quiet_after and sent + len(data) > self.quiet_after:
                    dst.sendall(data[: self.quiet_after - sent])
                    self._stop.wait()  # the link goes quiet; the connection stays open
                    break
                dst.sendall(data)
                sent += len(data)
                if rate:
                    ahead = started + sent / rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        for s in self._sockets:
            s.close()


@contextmanager
def two_nodes(
    rate: float, *, bulk: bool, quiet_after: int = 0
) -> Iterator[tuple[DaemonClient, DaemonClient, DaemonProcess]]:
    """Node a fetches from node b over a relay that carries b's answers at `rate` B/s:
    over the bulk stream (`bulk`, relayed as well) or gRPC FetchFile (b has no bulk
    listener). `quiet_after`: see SlowRelay; for the bulk stream only (the control calls
    keep flowing)."""
    with ExitStack() as stack:
        port_a, port_b, bulk_b = free_ports(3)
        relay = SlowRelay(port_b, rate, target_host="127.0.0.2")
        stack.callback(relay.close)
        if bulk:
            bulk_relay = SlowRelay(
                bulk_b, rate, port=bulk_b, target_host="127.0.0.2", quiet_after=quiet_after
            )
            stack.callback(bulk_relay.close)
        nodes = []
        for me, listen, other, other_address in (
            ("a", f"127.0.0.1:{port_a}", "b", f"127.0.0.1:{relay.port}"),
            ("b", f"127.0.0.2:{port_b}", "a", f"127.0.0.1:{port_a}"),
        ):
            config: dict[str, Any] = {
                "node": {"id": me, "failure_domain": f"rack-{me}"},
                "listen": {"peer": listen}
                | ({"peer_bulk_port": bulk_b} if me == "b" and bulk else {})
                | ({} if me == "a" or bulk else {"peer_bulk": False}),
                "replication": {"copies": 0, "heal_interval": 3600.0},
                "peers": [
                    {"id": other, "address": other_address, "failure_domain": f"rack-{other}"}
                ],
            }
            daemon = DaemonProcess(config, name=me, start=False)
            stack.callback(daemon.cleanup)
            nodes.append(daemon)
        for daemon in nodes:
            daemon.start(timeout=120.0)
        clients = [DaemonClient(d.address, timeout_s=120) for d in nodes]
        for c in clients:
            stack.callback(c.close)
        yield clients[0], clients[1], nodes[0]


def save_on(client: DaemonClient, checkpoint_id: str, data: bytes) -> None:
    client.begin_checkpoint(NS, checkpoint_id, 0)
    client.reserve_space(NS, checkpoint_id, 0, len(data) + 16)
    for name, content in (("__0_0.distcp", data), (".metadata", b"meta")):
        opened = client.open_file(NS, checkpoint_id, name, 0)
        fd = os.open(opened.path, os.O_WRONLY)
        try:
            writer = ChecksummingWriter(fd)
            writer.write(content)
            size, checksums = writer.finish()
        finally:
            os.close(fd)
        client.commit_file(NS, checkpoint_id, name, 0, size, checksums)
    client.commit_checkpoint(NS, checkpoint_id, ["__0_0.distcp", ".metadata"])


def wait_known(client: DaemonClient, checkpoint_id: str) -> None:
    deadline = time.monotonic() + 30
    while checkpoint_id not in {i.checkpoint_id for i in client.list_checkpoints(NS)}:
        assert time.monotonic() < deadline, f"{checkpoint_id} never published to node a"
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def short_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPTD_TEST_FETCH_STALL", str(STALL))


def test_a_link_too_slow_for_the_stall_window_says_too_slow_not_no_data() -> None:
    # 256 KiB/s: bytes flow all along, but a 1 MiB message takes 4 s, past the 2 s window
    # (before: 4 MiB messages, 16 s each, and "STALLED: no data for 10 s").
    # Over gRPC FetchFile: the bulk stream's progress is any byte, see the bulk test.
    data = os.urandom(SIZE)
    with two_nodes(rate=256 << 10, bulk=False) as (a, b, _):
        save_on(b, "step-1", data)
        wait_known(a, "step-1")
        with pytest.raises(TierUnavailable) as e:
            a.ensure_local(NS, "step-1", "__0_0.distcp")
    message = str(e.value)
    assert "peer b" in message and "too slow (" in message, message
    assert "no data" not in message and "no answer" not in message, message
    # the bytes that came before it gave up are counted (the first message at least)
    received = int(message.split("too slow (")[1].split(" bytes")[0].replace(",", ""))
    assert received >= 64 << 10, message


def test_a_bulk_stream_that_goes_quiet_after_bytes_came_says_too_slow_not_no_answer() -> None:
    # The bulk stream over the slow link: 256 KiB/s for 1 MiB, then nothing. The bytes
    # land in the fetcher's 4 MiB receive buffer before any piece is handed on; a stall
    # there still counts them ("too slow (N bytes"), never "no answer".
    data = os.urandom(SIZE)
    with two_nodes(rate=256 << 10, bulk=True, quiet_after=1 << 20) as (a, b, _):
        save_on(b, "step-3", data)
        wait_known(a, "step-3")
        with pytest.raises(TierUnavailable) as e:
            a.ensure_local(NS, "step-3", "__0_0.distcp")
    message = str(e.value)
    assert "peer b" in message and "too slow (" in message, message
    assert "no data" not in message and "no answer" not in message, message
    received = int(message.split("too slow (")[1].split(" bytes")[0].replace(",", ""))
    assert received >= 64 << 10, message


@pytest.mark.parametrize("bulk", [False, True], ids=["fetchfile", "bulk"])
def test_a_slow_but_flowing_link_restores_the_file_bit_exact(bulk: bool) -> None:
    # 1.5 MiB/s: each 1 MiB message arrives within the window; 12 MiB take about 8 s.
    data = os.urandom(SIZE)
    with two_nodes(rate=1.5 * (1 << 20), bulk=bulk) as (a, b, _):
        save_on(b, "step-2", data)
        wait_known(a, "step-2")
        entry = a.ensure_local(NS, "step-2", "__0_0.distcp")
        with open(entry.local_path, "rb") as f:
            assert f.read() == data
