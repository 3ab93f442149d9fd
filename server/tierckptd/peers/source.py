"""`PeerSource`: one peer as a `restore.FileSource` (ask its holdings, then fetch).

A peer that does not answer, or refuses, is *unavailable* (`SourceUnavailable("peer
<node>", cause)`); one that answers without the file is *missing*
(`CheckpointNotFound`); one whose copy fails its own verification while it serves it
is *corrupt* (DATA_LOSS -> `ChecksumMismatch`). Bytes are verified where they land
(`memory.incoming.install_copy`), never trusted here.
"""

from __future__ import annotations

from collections.abc import Iterator

from tierckpt.checksum import BytesLike
from tierckpt.errors import CheckpointNotFound, ChecksumMismatch

from tierckptd.model import FileRecord
from tierckptd.peers.client import PeerCallError, PeerClient

__all__ = ["PeerSource", "peer_sources"]


class PeerSource:
    """A peer node's copy of a committed file (see the module docstring)."""

    def __init__(self, client: PeerClient, node: str) -> None:
        self.client = client
        self.node = node

    @property
    def name(self) -> str:
        return f"peer {self.node}"

    def __repr__(self) -> str:
        return f"PeerSource({self.node!r})"

    def chunks(
        self, namespace: str, checkpoint_id: str, f: FileRecord
    ) -> Iterator[tuple[int, BytesLike]]:
        what = f"{namespace}/{checkpoint_id}/{f.name}"
        # Ask first: waits for a restarting peer's channel, skips a non-holder.
        held = self.client.holdings(self.node, namespace, checkpoint_id)
        if f.name not in held.names:
            raise CheckpointNotFound(f"node {self.node} holds no copy of {what}")
        try:
            yield from self.client.fetch(self.node, namespace, checkpoint_id, f.name)
        except PeerCallError as e:
            if e.code == "NOT_FOUND":
                raise CheckpointNotFound(
                    f"node {self.node} no longer holds {what}: {e.details}"
                ) from None
            if e.code == "DATA_LOSS":
                raise ChecksumMismatch(f"node {self.node}'s copy of {what}: {e.details}") from None
            raise

    def landed(self, namespace: str, checkpoint_id: str, f: FileRecord) -> None:
        """The copy is installed here: tell the peers this node now holds one (unless it
        is the owner's own copy coming back)."""
        if f.owner_node == self.client.node_id:
            return
        self.client.each(
            lambda node: self.client.update_replicas(
                node, namespace, checkpoint_id, f.name, list(f.replica_nodes)
            )
        )


def peer_sources(client: PeerClient, f: FileRecord) -> list[PeerSource]:
    """The peers to ask for `f`, in order: its owner, each replica holder, then every
    other configured peer (each once, never this node)."""
    me = client.node_id
    peers = client.peer_ids
    order = [f.owner_node, *f.replica_nodes, *peers]
    return [
        PeerSource(client, node)
        for node in dict.fromkeys(n for n in order if n and n != me and n in peers)
    ]
