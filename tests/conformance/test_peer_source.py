"""The FileSource contract against the peer tier: a real tierckptd process serving its
memory tier on a loopback peer port, read through `PeerSource` (PeerClient, gRPC).

The restoring node ("node-dest") is one of the daemon's configured [[peers]], so the
daemon answers it. An outage stops the daemon (SIGTERM); the service comes back as the
same node on the same port and memory dir (it re-adopts what it held).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.daemon_client import DaemonClient
from tierckptd.catalog import Catalog
from tierckptd.config import PeerConfig
from tierckptd.memory.manifest import read_manifest
from tierckptd.model import FileRecord
from tierckptd.peers.client import PeerClient
from tierckptd.peers.membership import PEER_CHANNEL_OPTIONS, Membership
from tierckptd.peers.source import PeerSource
from tierckptd.restore import FileSource

from tests.conformance.file_source_contract import BLOCK, Backend, FileSourceContract
from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_ports
from tests.support.source_nodes import flip_byte

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

    def __init__(
        self, make_daemon: Callable[..., DaemonProcess], node_id: str, dest_address: str
    ) -> None:
        self.node_id = node_id
        self.port = free_ports(1)[0]
        self.address = f"127.0.0.1:{self.port}"
        self.daemon = make_daemon(
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
            fd = os.open(path, os.O_WRONLY)
            try:
                view = memoryview(data)
                while view.nbytes:
                    view = view[os.write(fd, view) :]
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)
            c.commit_file(
                namespace, checkpoint_id, name, 0, len(data), checksum_bytes(data, BLOCK)
            )
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
        self.daemon.start()

    def close(self) -> None:
        self.client.close()
        for client in self._peer_clients:
            client.membership.close()


class TestPeerSource(FileSourceContract):
    @pytest.fixture
    def backend(
        self, daemon_factory: Callable[..., DaemonProcess], dest_address: str
    ) -> Iterator[PeerBackend]:
        b = PeerBackend(daemon_factory, "node-b", dest_address)
        yield b
        b.close()

    @pytest.fixture
    def other_backend(
        self, daemon_factory: Callable[..., DaemonProcess], dest_address: str
    ) -> Iterator[PeerBackend]:
        b = PeerBackend(daemon_factory, "node-c", dest_address)
        yield b
        b.close()
