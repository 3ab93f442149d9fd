"""Several real tierckptd nodes on 127.0.0.1, each its own failure domain, every node
peering with all the others (one node: no peer listener at all)."""

from __future__ import annotations

import shutil
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from tierckpt.daemon_client import DaemonClient

from tests.support import jobs
from tests.support.backends import Nodes
from tests.support.daemon_process import DaemonProcess
from tests.support.dist_job import run_job
from tests.support.ports import free_ports
from tests.support.raw_rpc import raw_save
from tests.support.waiting import wait_until

__all__ = ["LocalCluster", "local_cluster", "save_job"]


class LocalCluster:
    """`n` daemons `{id_prefix}{i}` in failure domains `rack{i}`; node 0 serves metrics.

    `overrides` are top-level config tables applied to every node (e.g. `persistent`).
    """

    def __init__(
        self,
        stack: ExitStack,
        n: int,
        *,
        namespace: str,
        copies: int = 1,
        heal_interval: float = 3600.0,
        id_prefix: str = "node",
        overrides: dict[str, Any] | None = None,
        metrics_all: bool = False,
    ) -> None:
        self.namespace = namespace
        ports = free_ports(2 * n if metrics_all else n + 1)
        self.metrics_port = ports[n]
        # Every node's metrics port with `metrics_all` (the scale bench), else node 0's.
        self.metrics_ports = ports[n:] if metrics_all else ports[n : n + 1]
        ids = [f"{id_prefix}{i}" for i in range(n)]
        self.nodes: list[DaemonProcess] = []
        for i in range(n):
            config: dict[str, Any] = {
                "node": {"id": ids[i], "failure_domain": f"rack{i}"},
                "listen": {"peer": f"127.0.0.1:{ports[i]}" if n > 1 else ""},
                "replication": {"copies": copies, "heal_interval": heal_interval},
                **(overrides or {}),
            }
            peers = [
                {"id": ids[j], "address": f"127.0.0.1:{ports[j]}", "failure_domain": f"rack{j}"}
                for j in range(n)
                if j != i
            ]
            if peers:
                config["peers"] = peers
            if i < len(self.metrics_ports):
                config["metrics"] = {"listen": f"127.0.0.1:{self.metrics_ports[i]}"}
            daemon = DaemonProcess(config, name=ids[i], start=False)
            stack.callback(daemon.cleanup)
            self.nodes.append(daemon)
        # Started side by side: 32 daemons one after the other take minutes on 2 cores.
        with futures.ThreadPoolExecutor(min(n, 8)) as pool:
            list(pool.map(lambda d: d.start(timeout=120.0), self.nodes))

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(d.address for d in self.nodes)

    def raw_save(self, node: int, checkpoint_id: str, files: dict[str, bytes]) -> str:
        """One rank's whole save through node `node` (it owns every file and coordinates);
        the committed id."""
        client = DaemonClient(self.nodes[node].address, timeout_s=60)
        try:
            return raw_save(client, self.namespace, checkpoint_id, files)
        finally:
            client.close()

    def lose(self, *indices: int) -> None:
        """kill -9 nodes and wipe their memory tier (the node died with its RAM)."""
        for i in indices:
            self.nodes[i].kill9()
            shutil.rmtree(self.nodes[i].memory_dir, ignore_errors=True)

    def replace(self, *indices: int) -> None:
        """Start an empty replacement with the same node id (several side by side, as at
        construction: each start is seconds of interpreter and import on 2 cores)."""
        if len(indices) == 1:
            self.nodes[indices[0]].start()
            return
        with futures.ThreadPoolExecutor(min(len(indices), 8)) as pool:
            list(pool.map(lambda i: self.nodes[i].start(timeout=120.0), indices))

    def rows(self, i: int = 0) -> dict[str, dict[str, Any]]:
        """Node i's `tierckpt ls --json` rows of the namespace, by checkpoint id.

        The CLI's own rows (`CheckpointInfo.to_json`) from an in-process client: the tests
        poll these, and a `tierckpt` subprocess per node and poll costs an interpreter
        start, taken from the daemons under test (the CLI itself: test_cli.py).
        """
        client = DaemonClient(self.nodes[i].address, timeout_s=30)
        try:
            return {c.checkpoint_id: c.to_json() for c in client.list_checkpoints(self.namespace)}
        finally:
            client.close()

    def wait_state(
        self,
        checkpoint_id: str,
        state: str,
        *,
        timeout: float = 120.0,
        nodes: tuple[int, ...] | None = None,
    ) -> None:
        """Until every node (or the `nodes` given) lists the checkpoint in `state` (the
        `state` of its `ls` row). Polled through one in-process client per node, as `rows`.
        """
        waited = [self.nodes[i] for i in nodes] if nodes is not None else list(self.nodes)
        clients = [DaemonClient(d.address, timeout_s=30) for d in waited]
        seen: dict[str, str | None] = {}

        def reached() -> bool:
            for daemon, client in zip(waited, clients, strict=True):
                rows = client.list_checkpoints(self.namespace)
                seen[daemon.name] = next(
                    (r.state for r in rows if r.checkpoint_id == checkpoint_id), None
                )
            return all(s == state for s in seen.values())

        try:
            wait_until(
                f"{checkpoint_id} {state} on every node",
                reached,
                timeout,
                interval=0.3,
                details=lambda: f"{seen}\n" + "\n".join(d.log_tail(40) for d in waited),
            )
        finally:
            for client in clients:
                client.close()

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
        """Until `check()` holds; on a timeout, fail with every node's log tail."""
        wait_until(
            what, check, timeout, details=lambda: "\n".join(d.log_tail(30) for d in self.nodes)
        )

    def metrics(self) -> str:
        """Node 0's Prometheus exposition."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return str(r.read().decode())


@contextmanager
def local_cluster(n: int, **kwargs: Any) -> Iterator[LocalCluster]:
    """A started `LocalCluster`, every node stopped and wiped on exit."""
    with ExitStack() as stack:
        yield LocalCluster(stack, n, **kwargs)


def save_job(
    c: LocalCluster,
    world: int,
    ranks_per_node: int,
    ids: list[str],
    root: Path,
    seed: int,
    *,
    timeout: float = 180.0,
) -> None:
    """`world` gloo ranks (`ranks_per_node` on each node, rank r on node r // it) save
    checkpoints `ids` of `c.namespace`; the states they saved are kept under `root`."""
    backend = Nodes(c.namespace, c.addresses, ranks_per_node)
    run_job(jobs.save_only, world, backend, ids, str(root), seed, timeout=timeout)
