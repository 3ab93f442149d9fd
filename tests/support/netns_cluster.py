"""Real tierckptd nodes on a `Testbed`: each daemon runs in its node's network namespace
and serves its peers on its node's bridge address (not 127.0.0.1), so every replica,
fetch and heal crosses the bridge, its shapers and its faults.

Peers on a network address must authenticate (DESIGN invariant 11): the cluster shares
one random token file. Each daemon's local unix socket lives in its temp dir as in
`DaemonProcess`; unix sockets on the filesystem are not bound to a network namespace, so
the test process and the node's ranks reach their daemon there as on a real host.
"""

from __future__ import annotations

import secrets
import shutil
import sys
import tempfile
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tierckpt.daemon_client import DaemonClient

from tests.support.cluster import LocalCluster
from tests.support.daemon_process import DaemonProcess
from tests.support.testbed import Node, Testbed

__all__ = ["PEER_PORT", "NetnsCluster", "NetnsDaemon"]

PEER_PORT = 7070  # every node has its own port space: the same port on every address
METRICS_PORT = 9400


class NetnsDaemon(DaemonProcess):
    """A `DaemonProcess` started inside `node`'s network namespace (`ip netns exec`, which
    execs the daemon: `pid` is the daemon's own)."""

    def __init__(self, node: Node, config_overrides: dict[str, Any], *, name: str) -> None:
        self.node = node
        super().__init__(config_overrides, name=name, start=False)

    def command(self, argv: list[str]) -> list[str]:
        return self.node.exec_argv(argv)

    def __repr__(self) -> str:
        return f"NetnsDaemon({self.name}, {self.node.netns}, running={self.running})"


class NetnsCluster(LocalCluster):
    """One daemon `n<i>` per testbed node, in failure domain `node.rack`, peering with
    every other node over the bridge; the `LocalCluster` helpers (raw_save, rows,
    wait_state, lose, replace) work unchanged. Every node serves metrics on its address.

    `overrides` are top-level config tables applied to every node.
    """

    def __init__(
        self,
        stack: ExitStack,
        bed: Testbed,
        *,
        namespace: str,
        copies: int = 1,
        heal_interval: float = 3600.0,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        self.bed = bed
        self.namespace = namespace
        self.metrics_port = METRICS_PORT
        self.metrics_ports = [METRICS_PORT]
        secret_dir = Path(tempfile.mkdtemp(prefix="tcnet"))
        stack.callback(shutil.rmtree, secret_dir, ignore_errors=True)
        token = secret_dir / "token"
        token.write_text(secrets.token_urlsafe(32))
        token.chmod(0o600)
        ids = [f"n{node.index}" for node in bed.nodes]
        self.nodes: list[DaemonProcess] = []
        for node in bed.nodes:
            config: dict[str, Any] = {
                "node": {"id": ids[node.index], "failure_domain": node.rack},
                "listen": {"peer": f"{node.address}:{PEER_PORT}"},
                "replication": {"copies": copies, "heal_interval": heal_interval},
                "security": {"token_file": str(token)},
                "metrics": {"listen": f"{node.address}:{METRICS_PORT}"},
                **(overrides or {}),
            }
            peers = [
                {
                    "id": ids[o.index],
                    "address": f"{o.address}:{PEER_PORT}",
                    "failure_domain": o.rack,
                }
                for o in bed.nodes
                if o is not node
            ]
            if peers:
                config["peers"] = peers
            daemon = NetnsDaemon(node, config, name=ids[node.index])
            stack.callback(daemon.cleanup)
            self.nodes.append(daemon)
        with futures.ThreadPoolExecutor(min(len(self.nodes), 8)) as pool:
            list(pool.map(lambda d: d.start(timeout=120.0), self.nodes))
        self.clients = [DaemonClient(d.address, timeout_s=30) for d in self.nodes]
        for client in self.clients:
            stack.callback(client.close)

    def holders(self, checkpoint_id: str, node: int = 0) -> dict[str, tuple[str, ...]]:
        """What daemon `node` says of each file of the checkpoint: its owner then the
        nodes holding replicas (`GetCheckpoint`)."""
        info = self.clients[node].get_checkpoint(self.namespace, checkpoint_id)
        return {f.name: (f.owner_node, *f.replica_nodes) for f in info.files}

    def metrics(self, node: int = 0) -> str:
        """Node `node`'s Prometheus exposition, read from inside its namespace."""
        url = f"http://{self.bed.nodes[node].address}:{METRICS_PORT}/metrics"
        code = (
            "import sys, urllib.request\n"
            f"sys.stdout.write(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
        )
        return self.bed.run_in(self.bed.nodes[node], [sys.executable, "-c", code]).stdout
