"""Surplus copies trimmed, memory copies scrubbed, healer pushes that recover: real
tierckptd processes on 127.0.0.1 (tests/support/peer_nodes.py), copies = 1.

- An owner that comes back after healing replaced its copies leaves three copies of
  some files: every node drops its own surplus copy until each file has exactly k + 1,
  the kept ones bit-exact, replica lists agreeing with the disks on every node.
- A flipped byte in a replica's memory copy is found by the scrubber, the copy dropped
  and repaired from the owner, bit-exact, with no read of the checkpoint by anyone.
- A node that missed the commit's publish (its save still unfinished there) refuses the
  coordinator's push NOT_FOUND: the healer publishes and pushes again.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from tests.support.peer_nodes import NS, Nodes, payload

pytestmark = pytest.mark.integration

FILES = {
    0: {"__0_0.distcp": payload(1, (1 << 20) + 17), ".metadata": b"meta" * 100},
    1: {"__1_0.distcp": payload(2, 5000)},
    2: {"__2_0.distcp": payload(3, 300_000)},
}
DATA = {name: data for named in FILES.values() for name, data in named.items()}


@pytest.fixture
def nodes_factory() -> Iterator[Callable[..., Nodes]]:
    with ExitStack() as stack:
        yield lambda n, **kw: Nodes(stack, n, **kw)


def on_disk(nodes: Nodes, checkpoint_id: str, name: str) -> list[str]:
    """The nodes whose memory dir has a copy of `name` (bit-exact or not)."""
    return [d.name for d in nodes.nodes if (d.data_dir(NS, checkpoint_id) / name).exists()]


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_an_owner_that_comes_back_leaves_exactly_k_extra_copies(
    nodes_factory: Callable[..., Nodes],
) -> None:
    nodes = nodes_factory(3, heal_interval=0.5)
    nodes.save("step-1", FILES)
    nodes.wait_replicated("step-1")
    nodes.nodes[1].kill9()  # its memory stays: it comes back with every copy it had

    def healed_without_n1() -> bool:
        return all(
            len([n for n in on_disk(nodes, "step-1", name) if n != "n1"]) == 2 for name in DATA
        )

    nodes.wait("healing to n0 and n2 while n1 is down", healed_without_n1, timeout=60)
    surplus = [name for name in DATA if len(on_disk(nodes, "step-1", name)) == 3]
    assert surplus, "n1 held a copy of some file: it now has three"
    nodes.nodes[1].start()

    last = ""

    def trimmed() -> bool:
        nonlocal last
        disks = {name: on_disk(nodes, "step-1", name) for name in DATA}
        last = f"on disk: {disks}"
        if any(len(holders) != 2 for holders in disks.values()):
            return False
        for node, c in zip(nodes.nodes, nodes.clients, strict=True):
            info = c.get_checkpoint(NS, "step-1")
            lists = {f.name: [f.owner_node, *f.replica_nodes] for f in info.files}
            last = f"{node.name} lists {info.state} {lists}; on disk: {disks}"
            if info.state != "REPLICATED" or any(
                set(lists[name]) != set(disks[name]) for name in DATA
            ):
                return False
        return True

    try:
        nodes.wait("every file at exactly 2 copies, listed so on every node", trimmed, timeout=120)
    except AssertionError as e:
        raise AssertionError(f"{last}\n{e}") from None
    for name, data in DATA.items():
        for node in on_disk(nodes, "step-1", name):
            path = nodes.nodes[int(node[1:])].data_dir(NS, "step-1") / name
            assert path.read_bytes() == data, f"{node}'s copy of {name}"
    logs = "".join(d.log_path.read_text() for d in nodes.nodes)
    assert logs.count("dropped the surplus copy") >= len(surplus), logs[-4000:]
    for c in nodes.clients:  # a heal round later, nothing moves again
        ok, _, corrupt = c.verify_checkpoint(NS, "step-1")
        assert ok and not corrupt


def test_a_flipped_byte_in_a_replica_is_scrubbed_and_repaired_without_a_read(
    nodes_factory: Callable[..., Nodes],
) -> None:
    nodes = nodes_factory(
        2,
        heal_interval=3600.0,
        overrides={"memory": {"scrub_rate": "256MiB", "scrub_interval": 0.5}},
    )
    nodes.save("step-2", {0: FILES[0], 1: FILES[1]})
    nodes.wait_replicated("step-2")
    # n0 (metrics on node 0) holds the replica of n1's file.
    victim = nodes.nodes[0].data_dir(NS, "step-2") / "__1_0.distcp"
    good = DATA["__1_0.distcp"]
    assert victim.read_bytes() == good
    os.chmod(victim, 0o600)
    with open(victim, "r+b") as fh:
        fh.seek(1234)
        fh.write(bytes([good[1234] ^ 0x10]))
    os.chmod(victim, 0o440)

    def repaired() -> bool:
        text = nodes.metrics()
        return (
            metric(text, "tierckpt_repaired_copies_total") >= 1
            and victim.exists()
            and victim.read_bytes() == good
        )

    nodes.wait("the scrubber to find and repair n0's copy", repaired, timeout=60)
    text = nodes.metrics()
    assert metric(text, 'tierckpt_corrupt_copies_total{where="scrubbed"}') == 1.0
    assert metric(text, "tierckpt_scrubbed_bytes_total") > 0
    assert metric(text, "tierckpt_scrub_last_pass_unix") > 0
    log = nodes.nodes[0].log_path.read_text()
    assert "corrupt copy of peerd/step-2/__1_0.distcp on node n0 (scrubbed)" in log
    assert "checksum mismatch in block" in log
    for i, c in enumerate(nodes.clients):  # the whole checkpoint is sound on both nodes
        ok, _, corrupt = c.verify_checkpoint(NS, "step-2")
        assert ok and not corrupt, i
    assert nodes.states("step-2") == ["REPLICATED", "REPLICATED"]


def test_a_push_refused_for_a_missed_publish_publishes_and_pushes_again(
    nodes_factory: Callable[..., Nodes], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every node's first publish fails: n0's is the commit's publish to n1, so n1 still
    # sees its save unfinished (abandon_after keeps it there) and refuses pushes.
    monkeypatch.setenv("TIERCKPT_FAULT", "peer.publish:error@1")
    nodes = nodes_factory(2, heal_interval=0.5)
    monkeypatch.delenv("TIERCKPT_FAULT")
    nodes.save("step-3", {0: FILES[0], 1: FILES[1]})
    nodes.wait_replicated("step-3", timeout=60)
    for name in ("__0_0.distcp", ".metadata", "__1_0.distcp"):
        assert sorted(on_disk(nodes, "step-3", name)) == ["n0", "n1"]
        path = nodes.nodes[1].data_dir(NS, "step-3") / name
        assert path.read_bytes() == DATA[name]
    log = nodes.nodes[0].log_path.read_text()
    assert "replicated peerd/step-3/__0_0.distcp to n1" in log
    assert "push of peerd/step-3" not in log  # no failed push was logged
