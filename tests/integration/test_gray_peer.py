"""A gray peer (audit 3, M1): a daemon that is SIGSTOPped keeps its TCP port open and
accepts connections, but never answers. Its neighbours must keep replicating: a new
checkpoint gets its extra copy on a healthy node within seconds, however many older
checkpoints the heal rounds go over, and once the gray peer answers again every node
converges on the same bit-exact copies."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from tests.support.peer_nodes import NS, Nodes, payload

pytestmark = pytest.mark.integration

OLDER = 10
# The old code took 30 s and more (one 2 s Holdings deadline per older checkpoint, asked
# one checkpoint after another on one replicator thread, each heal round again).
REPLICATED_WITHIN = 15.0


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    with ExitStack() as stack:
        yield Nodes(stack, 3, heal_interval=1.0)


_FILES: dict[int, dict[int, dict[str, bytes]]] = {}


def files(i: int) -> dict[int, dict[str, bytes]]:
    """Checkpoint i's one rank file and `.metadata` (the same bytes on every call)."""
    if i not in _FILES:
        _FILES[i] = {0: {"__0_0.distcp": payload(i, (64 << 10) + i), ".metadata": b"meta%d" % i}}
    return _FILES[i]


def test_a_gray_peer_does_not_stall_replication_to_the_others(nodes: Nodes) -> None:
    a, b, c = nodes.clients
    ids = [f"old-{i}" for i in range(OLDER)]
    for i, checkpoint_id in enumerate(ids):
        nodes.save(checkpoint_id, files(i))
    for checkpoint_id in ids:
        nodes.wait_replicated(checkpoint_id, timeout=60.0)

    gray = nodes.nodes[1]
    os.kill(gray.pid, signal.SIGSTOP)
    try:
        nodes.save("new", files(99))

        def on_c() -> str:
            rows = {i.checkpoint_id: i.state for i in c.list_checkpoints(NS)}
            return rows.get("new", "-")

        # The extra copy of the new checkpoint lands on c although b, its neighbour and
        # maybe its first placement candidate, never answers.
        nodes.wait(
            "the new checkpoint REPLICATED on the healthy peer",
            lambda: on_c() == "REPLICATED",
            REPLICATED_WITHIN,
        )
        assert (nodes.nodes[2].data_dir(NS, "new") / "__0_0.distcp").read_bytes() == files(99)[0][
            "__0_0.distcp"
        ]
        # Node a reports the gray peer as backed off (tierckpt_peer_backoff_seconds).
        gray_metric = f'tierckpt_peer_backoff_seconds{{peer="{gray.name}"}}'
        assert any(
            line.startswith(gray_metric) and float(line.split()[-1]) > 0
            for line in nodes.metrics().splitlines()
        ), nodes.metrics()
    finally:
        os.kill(gray.pid, signal.SIGCONT)

    # b answers again: every node converges, every copy is bit-exact.
    for checkpoint_id in [*ids, "new"]:
        nodes.wait_replicated(checkpoint_id, timeout=90.0)
    for i, checkpoint_id in enumerate([*ids, "new"]):
        want = files(99 if checkpoint_id == "new" else i)[0]
        for client in (a, b, c):
            ok, _, corrupt = client.verify_checkpoint(NS, checkpoint_id)
            assert ok and not corrupt, (checkpoint_id, corrupt)
        for f in a.get_checkpoint(NS, checkpoint_id).files:
            for holder in (f.owner_node, *f.replica_nodes):
                path = nodes.nodes[int(holder[1:])].data_dir(NS, checkpoint_id) / f.name
                assert path.read_bytes() == want[f.name], (checkpoint_id, holder, f.name)
