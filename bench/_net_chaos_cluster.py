"""The world bench/net_chaos.py breaks: bench/chaos.py's `ChaosCluster` (the job, the
loader, the bit-exact bookkeeping) with every daemon in its own network namespace of a
`Testbed`, and moto S3 on a host of its own on the same bridge.

Layout: `NODES` daemon nodes n0..n3 in two racks (failure domains) a = {n0, n2} and
b = {n1, n3}, and host n4 ("s3") serving moto on its bridge address. Daemon-to-daemon and
daemon-to-S3 bytes cross the bridge, so a cut, a slow link or a flap reaches replication,
heal, restore and drain alike; cutting n4 is an S3 outage by the network. The job's two
ranks run in the host's namespace and reach their nodes' daemons (n0, n1) through the
daemons' unix sockets, as ranks reach their local daemon on a real host.

The host has no address on the bridge (parallel testbeds share its subnet), so the runner
reaches moto from a thread inside n4's namespace (`NetnsThread`): moto's listener and
fsspec's event-loop thread are started there, and the loader process enters n4's
namespace before it loads anything.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import fsspec.asyn
from _chaos_cluster import NS, ChaosCluster, Loader
from _chaos_ranks import verifier_main
from moto.server import ThreadedMotoServer
from tierckpt.daemon_client import CheckpointInfo

from tests.support.daemon_process import DaemonProcess
from tests.support.moto_s3 import MotoServer
from tests.support.netns_cluster import METRICS_PORT, PEER_PORT, NetnsDaemon
from tests.support.netns_thread import NetnsThread, enter_netns
from tests.support.testbed import TbfShape, Testbed

__all__ = ["NODES", "RACKS", "NetChaosCluster"]

NODES = 4
RACKS = ("a", "b", "a", "b")
MOTO_PORT = 5000


class NetnsMoto(MotoServer):
    """moto's threaded server listening on the S3 host's bridge address; stop/restart as
    `MotoServer` (its state lives in this process)."""

    def __init__(self, thread: NetnsThread, address: str) -> None:
        self._thread = thread
        self._address = address
        self.port = MOTO_PORT
        self.running = False
        self.restart()

    def _serve(self) -> None:
        self._server = ThreadedMotoServer(ip_address=self._address, port=self.port, verbose=False)
        self._server.start()
        self.host, self.port = self._server.get_host_and_port()
        self.running = True

    def restart(self) -> None:
        if not self.running:
            self._thread.call(self._serve)


def netns_verifier(netns: str, conn: Any, namespace: str, world: int, rank_bytes: int) -> None:
    """`verifier_main` in the S3 host's namespace: its stock loads reach moto there, its
    tiered loads reach the daemons' unix sockets (files, in no namespace)."""
    enter_netns(netns)
    verifier_main(conn, namespace, world, rank_bytes)


class NetnsLoader(Loader):
    def __init__(self, rank_bytes: int, netns: str) -> None:
        self._netns = netns
        super().__init__(rank_bytes)

    def _start(self) -> None:
        from _chaos_cluster import WORLD

        self.conn, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(
            target=netns_verifier,
            args=(self._netns, child, NS, WORLD, self._rank_bytes),
            daemon=True,
        )
        self.proc.start()


class NetChaosCluster(ChaosCluster):
    """`ChaosCluster` on a testbed of NODES daemon hosts and one S3 host (see the module
    docstring); `shape` is every link's base token bucket (None: veth speed)."""

    def __init__(
        self,
        *,
        rank_bytes: int,
        pause: float,
        budget: str,
        seed: int,
        shape: TbfShape | None = None,
    ) -> None:
        self.bed = Testbed(NODES + 1, racks=[*RACKS, "s3"], shape=shape)
        self.s3_host = self.bed.nodes[NODES]
        self.frozen: set[int] = set()  # nodes whose daemon is SIGSTOPped now
        self._ns_thread = NetnsThread(self.s3_host.netns)
        # fsspec's one event-loop thread makes every s3fs connection of this process: it
        # must be born in the S3 host's namespace.
        self._ns_thread.call(fsspec.asyn.get_loop)
        self._secret_dir = Path(tempfile.mkdtemp(prefix="tcnet"))
        self.token = self._secret_dir / "token"
        self.token.write_text(secrets.token_urlsafe(32))
        self.token.chmod(0o600)
        try:
            super().__init__(rank_bytes=rank_bytes, pause=pause, budget=budget, seed=seed)
        except BaseException:
            self.bed.close()
            raise

    def make_moto(self) -> MotoServer:
        return NetnsMoto(self._ns_thread, self.s3_host.address)

    def make_loader(self, rank_bytes: int) -> Loader:
        return NetnsLoader(rank_bytes, self.s3_host.netns)

    def make_nodes(self, budget: str, options: dict[str, Any]) -> list[DaemonProcess]:
        hosts = self.bed.nodes[:NODES]
        nodes: list[DaemonProcess] = []
        for host in hosts:
            config: dict[str, Any] = {
                "node": {"id": f"n{host.index}", "failure_domain": host.rack},
                "listen": {"peer": f"{host.address}:{PEER_PORT}"},
                **self.node_config(budget, options),
                "security": {"token_file": str(self.token)},
                "metrics": {"listen": f"{host.address}:{METRICS_PORT}"},
                "peers": [
                    {
                        "id": f"n{o.index}",
                        "address": f"{o.address}:{PEER_PORT}",
                        "failure_domain": o.rack,
                    }
                    for o in hosts
                    if o is not host
                ],
            }
            nodes.append(NetnsDaemon(host, config, name=f"n{host.index}"))
        return nodes

    def listings(self) -> dict[int, dict[str, CheckpointInfo]]:
        """As `ChaosCluster.listings`, skipping frozen nodes (their calls would only time out)."""
        frozen = self.frozen
        out: dict[int, dict[str, CheckpointInfo]] = {}
        for i, d in enumerate(self.nodes):
            if d.running and i not in frozen:
                try:
                    out[i] = {c.checkpoint_id: c for c in self.clients[i].list_checkpoints(NS)}
                except Exception:  # noqa: BLE001 - a node restarting: not listed now
                    pass
        return out

    def close(self, logs: Path | None = None) -> None:
        for fault in self.bed.faults:  # thaw and reconnect first: stops are clean then
            fault.heal()
        self.frozen.clear()
        try:
            super().close(logs)
        finally:
            self._ns_thread.close()
            self.bed.close()
            shutil.rmtree(self._secret_dir, ignore_errors=True)
