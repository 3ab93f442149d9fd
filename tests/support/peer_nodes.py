"""Real tierckptd nodes driven exactly as the writer drives them (begin, reserve, open,
write, commit) with one DaemonClient per node: for peer-tier tests that need no torch."""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Any

from tierckpt.daemon_client import CheckpointInfo, DaemonClient

from tests.support.cluster import LocalCluster
from tests.support.raw_rpc import save_ranks

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
        return save_ranks(dict(enumerate(self.clients)), NS, checkpoint_id, files)

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
