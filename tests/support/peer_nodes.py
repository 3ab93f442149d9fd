"""Real tierckptd nodes driven exactly as the writer drives them (begin, reserve, open,
write, commit) with one DaemonClient per node: for peer-tier tests that need no torch."""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Any

from tierckpt.daemon_client import CheckpointInfo, DaemonClient
from tierckpt.memory_files import ChecksummingWriter

from tests.support.cluster import LocalCluster

__all__ = ["NS", "Nodes", "payload"]

NS = "peerd"


class Nodes(LocalCluster):
    """A LocalCluster with a DaemonClient per node, driven as the writer drives it
    (`overrides`: config tables for every node)."""

    def __init__(
        self,
        stack: ExitStack,
        n: int,
        *,
        heal_interval: float,
        copies: int = 1,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            stack,
            n,
            namespace=NS,
            copies=copies,
            heal_interval=heal_interval,
            id_prefix="n",
            overrides=overrides,
        )
        self.clients = [DaemonClient(d.address, timeout_s=30) for d in self.nodes]
        for c in self.clients:
            stack.callback(c.close)

    def save(self, checkpoint_id: str, files: dict[int, dict[str, bytes]]) -> CheckpointInfo:
        """Node i's rank i writes files[i]; node 0 is the coordinator."""
        for node, named in files.items():
            c = self.clients[node]
            c.begin_checkpoint(NS, checkpoint_id, node)
            c.reserve_space(NS, checkpoint_id, node, sum(len(d) for d in named.values()))
            for name, data in named.items():
                opened = c.open_file(NS, checkpoint_id, name, node)
                fd = os.open(opened.path, os.O_WRONLY)
                try:
                    writer = ChecksummingWriter(fd)
                    writer.write(data)
                    size, checksums = writer.finish()
                finally:
                    os.close(fd)
                c.commit_file(NS, checkpoint_id, name, node, size, checksums)
        required = [name for named in files.values() for name in named]
        return self.clients[0].commit_checkpoint(NS, checkpoint_id, required)

    def states(self, checkpoint_id: str) -> list[str]:
        out = []
        for c in self.clients:
            rows = {i.checkpoint_id: i.state for i in c.list_checkpoints(NS)}
            out.append(rows.get(checkpoint_id, "-"))
        return out

    def wait_replicated(self, checkpoint_id: str, timeout: float = 30.0) -> None:
        self.wait(
            f"{checkpoint_id} REPLICATED everywhere",
            lambda: set(self.states(checkpoint_id)) == {"REPLICATED"},
            timeout,
        )

    def lose_and_replace(self, i: int) -> None:
        self.lose(i)
        self.replace(i)


def payload(seed: int, size: int) -> bytes:
    return bytes((seed * 131 + i * 7) & 0xFF for i in range(251)) * (size // 251) + os.urandom(
        size % 251
    )
