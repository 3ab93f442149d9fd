"""An in-memory PeerClient for the healer, trim and commit unit tests (no gRPC): what
each peer holds, which are down, and every publish, push and replica update they got."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tierckpt.checksum import BytesLike
from tierckptd.config import PeerConfig
from tierckptd.model import CheckpointView, FileRecord
from tierckptd.peers.breaker import Breaker
from tierckptd.peers.client import Holdings, Manifests, PeerCallError, PeerClient
from tierckptd.peers.membership import Membership

__all__ = ["FakePeers"]


class FakePeers(PeerClient):
    """Peers in memory: what each holds, which are down, what was pushed.

    `refuse[node]` is the gRPC code that node's PushFile answers: NOT_FOUND until the node
    got a publish (it lacks the manifest), any other code always.
    """

    def __init__(self, me: str, peers: dict[str, str]) -> None:
        super().__init__(
            Membership(me, "r1", peers=[PeerConfig(n, "x:1", d) for n, d in peers.items()])
        )
        self.breaker = Breaker(first=0)  # peers go down and come back between two heals
        self.held: dict[str, dict[str, bytes]] = {n: {} for n in peers}
        self.knows: dict[str, bool] = {n: False for n in peers}
        self.down: set[str] = set()
        self.corrupt_on: set[str] = set()
        self.pushed: list[tuple[str, str]] = []
        self.published: list[str] = []
        self.replicas: list[tuple[str, str, list[str]]] = []
        self.refuse: dict[str, str] = {}
        self.durable: set[str] = set()  # peers that answer the checkpoint is durable
        self.push_attempts = 0

    def _up(self, node: str, method: str) -> None:
        if node in self.down:
            raise PeerCallError(node, method, "UNAVAILABLE", "down")

    def holdings(self, node: str, namespace: str, checkpoint_id: str) -> Holdings:
        self._up(node, "Holdings")
        return Holdings(self.knows[node], frozenset(self.held[node]), durable=node in self.durable)

    def publish(self, node: str, view: CheckpointView) -> None:
        self._up(node, "PublishCheckpoint")
        self.published.append(node)
        self.knows[node] = True

    def update_replicas(
        self, node: str, namespace: str, checkpoint_id: str, name: str, replicas: list[str]
    ) -> None:
        self._up(node, "UpdateReplicas")
        self.replicas.append((node, name, list(replicas)))

    def list_manifests(
        self, node: str, namespace: str = "", *, wait_for_ready: bool = True, starting: bool = False
    ) -> Manifests:
        self._up(node, "ListManifests")
        return Manifests([], [])

    def fetch(
        self, node: str, namespace: str, checkpoint_id: str, name: str
    ) -> Iterator[tuple[int, memoryview]]:
        self._up(node, "FetchFile")
        yield 0, memoryview(self.held[node][name])

    def offer(self, node: str, namespace: str, checkpoint_id: str, f: FileRecord) -> bool:
        """These peers take no offers (as an older node): the pusher pushes."""
        self._up(node, "OfferFile")
        return False

    def push(
        self,
        node: str,
        namespace: str,
        checkpoint_id: str,
        f: FileRecord,
        pieces: Iterable[tuple[int, BytesLike]],
    ) -> None:
        self.push_attempts += 1
        self._up(node, "PushFile")
        code = self.refuse.get(node)
        if code is not None and (code != "NOT_FOUND" or node not in self.published):
            raise PeerCallError(node, "PushFile", code, "refused")
        if node in self.corrupt_on:
            raise PeerCallError(node, "PushFile", "DATA_LOSS", "block 0 mismatch")
        data = b"".join(bytes(d) for _, d in pieces)
        self.held[node][f.name] = data
        self.pushed.append((node, f.name))
