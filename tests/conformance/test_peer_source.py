"""The FileSource contract against the peer tier: a real tierckptd process serving its
memory tier on a loopback peer port, read through `PeerSource` (PeerClient, gRPC).

The restoring node ("node-dest") is one of the daemon's configured [[peers]], so the
daemon answers it. An outage stops the daemon (SIGTERM); the service comes back as the
same node on the same port and memory dir (it re-adopts what it held). The two daemons
serve the whole module (each test saves into a namespace of its own) and are brought
back up after a test that stopped one.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.daemon_client import DaemonClient
from tierckptd.catalog import Catalog
from tierckptd.config import PeerConfig
from tierckptd.errors import SourceUnavailable
from tierckptd.memory.manifest import read_manifest
from tierckptd.model import FileRecord
from tierckptd.peers.client import PeerClient
from tierckptd.peers.membership import PEER_CHANNEL_OPTIONS, Membership
from tierckptd.peers.source import PeerSource
from tierckptd.restore import FileSource

from tests.conformance.file_source_contract import (
    BIG,
    BLOCK,
    OUTAGE_REPORTED_WITHIN,
    Backend,
    FileSourceContract,
    RestoringNode,
    files_of,
    within,
)
from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_ports
from tests.support.source_nodes import flip_byte, write_in_place

pytestmark = pytest.mark.integration

DEST = "node-dest"  # the restoring node of the contract


@pytest.fixture(scope="module")
def dest_address() -> Iterator[str]:
    """Where the daemons reach the restoring node, which is no daemon: a gRPC server
    without services, so their calls to it (startup manifest pull, commit publish) fail
    at once with UNIMPLEMENTED instead of waiting out a deadline on a dead port."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


class PeerBackend(Backend):
    """One tierckptd ("node-b", "node-c") whose peer port the restoring node asks."""

    def __init__(self, node_id: str, dest_address: str) -> None:
        self.node_id = node_id
        self.port = free_ports(1)[0]
        self.address = f"127.0.0.1:{self.port}"
        self.daemon = DaemonProcess(
            {
                "node": {"id": node_id, "failure_domain": f"rack-{node_id}"},
                "listen": {"peer": self.address},
                "peers": [{"id": DEST, "address": dest_address, "failure_domain": "rack-dest"}],
                # No extra copies: the restoring node is not pushed any.
                "replication": {"copies": 0, "heal_interval": 3600.0},
            },
            name=node_id,
        )
        self.client = DaemonClient(self.daemon.address)
        self._peer_clients: list[PeerClient] = []

    def store(
        self, namespace: str, checkpoint_id: str, files: Mapping[str, bytes]
    ) -> dict[str, FileRecord]:
        c = self.client
        c.begin_checkpoint(namespace, checkpoint_id, 0)
        c.reserve_space(namespace, checkpoint_id, 0, sum(len(d) for d in files.values()))
        for name, data in files.items():
            path = c.open_file(namespace, checkpoint_id, name, 0).path
            write_in_place(path, data)
            c.commit_file(namespace, checkpoint_id, name, 0, len(data), checksum_bytes(data, BLOCK))
        c.commit_checkpoint(namespace, checkpoint_id, list(files))
        rec = read_manifest(self.daemon.manifest_path(namespace, checkpoint_id))
        return dict(rec.files)

    def source(self, catalog: Catalog) -> FileSource:
        membership = Membership(
            catalog.node_id,
            peers=[PeerConfig(self.node_id, self.address, f"rack-{self.node_id}")],
            channel_factory=lambda a: grpc.insecure_channel(a, options=PEER_CHANNEL_OPTIONS),
        )
        client = PeerClient(membership)
        self._peer_clients.append(client)
        return PeerSource(client, self.node_id)

    def _path(self, namespace: str, checkpoint_id: str, name: str) -> Any:
        return self.daemon.data_dir(namespace, checkpoint_id) / name

    def corrupt_byte(self, namespace: str, checkpoint_id: str, name: str, offset: int) -> None:
        flip_byte(self._path(namespace, checkpoint_id, name), offset)

    def lose(self, namespace: str, checkpoint_id: str, name: str) -> None:
        os.unlink(self._path(namespace, checkpoint_id, name))

    def outage(self) -> None:
        self.daemon.terminate()

    def restore_service(self) -> None:
        if not self.daemon.running:
            self.daemon.start()

    def after_test(self, request: pytest.FixtureRequest) -> None:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(f"{self.daemon!r}\n{self.daemon.log_tail()}")
        for client in self._peer_clients:
            client.membership.close()
        self._peer_clients.clear()
        self.restore_service()

    def close(self) -> None:
        self.client.close()
        self.daemon.cleanup()


@pytest.fixture(scope="module")
def node_b(dest_address: str) -> Iterator[PeerBackend]:
    b = PeerBackend("node-b", dest_address)
    yield b
    b.close()


@pytest.fixture(scope="module")
def node_c(dest_address: str) -> Iterator[PeerBackend]:
    b = PeerBackend("node-c", dest_address)
    yield b
    b.close()


class TestPeerSource(FileSourceContract):
    @pytest.fixture
    def backend(self, node_b: PeerBackend, request: pytest.FixtureRequest) -> Iterator[PeerBackend]:
        yield node_b
        node_b.after_test(request)

    @pytest.fixture
    def other_backend(
        self, node_c: PeerBackend, request: pytest.FixtureRequest
    ) -> Iterator[PeerBackend]:
        yield node_c
        node_c.after_test(request)


def test_a_peer_that_freezes_mid_transfer_is_unavailable_within_seconds(
    node_b: PeerBackend, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A wedged peer host (SIGSTOP after the stream started): the read must fail as
    UNAVAILABLE within the contract's bound, not hold the restore (and its file lock)
    for the whole transfer timeout."""
    node = RestoringNode(tmp_path / "restoring-node")
    try:
        files = files_of(node.ns, "step-1", {BIG: 24 << 20})
        node.publish("step-1", node_b.store(node.ns, "step-1", files))
        source = node_b.source(node.catalog)
        f, _ = node.catalog.file_view(node.ns, "step-1", BIG)
        reader = iter(source.chunks(node.ns, "step-1", f))
        assert next(reader)[0] == 0
        os.kill(node_b.daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(SourceUnavailable) as e:
                within(OUTAGE_REPORTED_WITHIN, lambda: list(reader), "a read from a frozen peer")
            assert e.value.source == source.name
        finally:
            os.kill(node_b.daemon.pid, signal.SIGCONT)
    finally:
        node_b.after_test(request)
        node.close()
