"""The promises under partition (docs/reliability.md, "Promises under partition"), each
through real daemons on the multi-host testbed: four tierckptd nodes in their own network
namespaces, racks a = {n0, n2} and b = {n1, n3}, `copies = 1`, heal rounds every second.

1. A save during a cut either commits with the copies it reports, or fails with an error
   naming the node it could not reach.
2. No listing says REPLICATED for a file lacking its copies (checked on disk, on every
   node's listing, during and after every cut here).
3. No committed checkpoint is lost when at most `copies` failure domains are cut: with
   rack a's cables pulled, every file of every REPLICATED checkpoint restores bit-exact
   through rack b.
4. After a cut heals the cluster converges: what a cut-off node saved is REPLICATED on
   every node within the breaker's back-off cap and a few heal rounds (printed).
5. A frozen peer costs a restore at most its stall timeout, never a hang.

One testbed and one cluster serve the module (start-ups are the suite's cost); every
fault is healed on leaving its `with` block, and each test uses its own checkpoint ids.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import TierckptError
from tierckptd.peers.breaker import BACKOFF_CAP
from tierckptd.peers.client import FETCH_STALL

from tests.support.netns_cluster import NetnsCluster
from tests.support.peer_nodes import payload
from tests.support.raw_rpc import save_ranks, write_files
from tests.support.testbed import Testbed, TestbedUnavailable, unavailable_reason
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

NS = "parts"
COPIES = 1
HEAL_INTERVAL = 1.0
REQUIRE_ENV = "TIERCKPT_REQUIRE_TESTBED"


def _unavailable(reason: str) -> None:
    message = f"multi-host testbed unavailable: {reason}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} ({REQUIRE_ENV}=1)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    reason = unavailable_reason()
    if reason is not None:
        _unavailable(reason)
    try:
        testbed = Testbed(4, racks=["a", "b", "a", "b"])
    except TestbedUnavailable as exc:
        _unavailable(str(exc))
    try:
        yield testbed
    finally:
        testbed.close()


@pytest.fixture(scope="module")
def cluster(bed: Testbed) -> Iterator[NetnsCluster]:
    with ExitStack() as stack:
        yield NetnsCluster(stack, bed, namespace=NS, copies=COPIES, heal_interval=HEAL_INTERVAL)


def _files(seed: int, names: tuple[str, ...], size: int = 256 << 10) -> dict[str, bytes]:
    return {name: payload(seed * 31 + i, size + i) for i, name in enumerate(names)}


def _on_disk(cluster: NetnsCluster, name: str, checkpoint_id: str, file_name: str) -> bytes:
    node = next(d for d in cluster.nodes if d.name == name)
    path = node.data_dir(NS, checkpoint_id) / file_name
    return path.read_bytes() if path.is_file() else b""


def _lacking(cluster: NetnsCluster) -> list[str]:
    """Every (node, checkpoint, file) a node lists REPLICATED (not DURABLE: there is no
    persistent tier here) while fewer than copies + 1 of the holders it names have the
    file on disk."""
    found = []
    for i, client in enumerate(cluster.clients):
        for info in client.list_checkpoints(NS):
            if info.state != "REPLICATED":
                continue
            for f in info.files:
                holders = [h for h in (f.owner_node, *f.replica_nodes) if h]
                present = [h for h in holders if _on_disk(cluster, h, info.checkpoint_id, f.name)]
                if len(present) < COPIES + 1:
                    found.append(f"n{i}: {info.checkpoint_id}/{f.name} on {present} of {holders}")
    return found


def assert_honest(cluster: NetnsCluster) -> None:
    """Promise 2, read twice 1 s apart (a surplus copy trimmed between the listing and the
    disk read is not a lie; a lie is still there the second time)."""
    first = _lacking(cluster)
    if first:
        time.sleep(1.0)
        still = set(first) & set(_lacking(cluster))
        assert not still, f"listed REPLICATED without its copies: {sorted(still)}"


def _states(cluster: NetnsCluster, checkpoint_id: str) -> list[str | None]:
    out = []
    for client in cluster.clients:
        rows = {r.checkpoint_id: r.state for r in client.list_checkpoints(NS)}
        out.append(rows.get(checkpoint_id))
    return out


def _restore(client: DaemonClient, checkpoint_id: str, expected: dict[str, bytes]) -> float:
    """Every file made local through `client`'s daemon and compared; the seconds it took."""
    started = time.monotonic()
    for name, data in expected.items():
        entry = client.ensure_local(NS, checkpoint_id, name)
        assert Path(entry.local_path).read_bytes() == data, f"{checkpoint_id}/{name} differs"
    return time.monotonic() - started


def test_a_save_during_a_cut_commits_with_the_copies_it_reports_or_names_the_unreachable(
    bed: Testbed, cluster: NetnsCluster
) -> None:
    c = cluster.clients
    names = ("__0_0.distcp", "__1_0.distcp", ".metadata")
    # A writer's node (n1, rank 1) cut after its rank wrote and before the commit: the
    # coordinator cannot have n1's file; the commit fails naming n1.
    files = {0: _files(1, names[0::2]), 1: _files(2, names[1:2])}
    write_files(c[1], NS, "cut-writer", files[1], rank=1)
    write_files(c[0], NS, "cut-writer", files[0], rank=0)
    with bed.cut_node(bed.nodes[1]):
        with pytest.raises(TierckptError) as failed:
            c[0].commit_checkpoint(NS, "cut-writer", names, holder_nodes=["n0", "n1"])
        assert "n1" in str(failed.value), str(failed.value)
        assert "cut-writer" not in {r.checkpoint_id for r in c[0].list_checkpoints(NS)}
        assert_honest(cluster)

    # A bystander (n3) cut during the whole save: it commits, and every holder the commit
    # and the listings name has the file, byte for byte.
    files = {0: _files(3, names[0::2]), 1: _files(4, names[1:2])}
    every = {**files[0], **files[1]}
    with bed.cut_node(bed.nodes[3]):
        info = save_ranks({0: c[0], 1: c[1]}, NS, "cut-bystander", files)
        for f in info.files:
            for holder in (f.owner_node, *f.replica_nodes):
                assert _on_disk(cluster, holder, "cut-bystander", f.name) == every[f.name]
        cluster.wait(
            "cut-bystander REPLICATED on the reachable nodes",
            lambda: _states(cluster, "cut-bystander")[:3] == ["REPLICATED"] * 3,
        )
        assert_honest(cluster)
    assert_honest(cluster)


def test_no_listing_says_replicated_without_its_copies_during_a_rack_cut(
    bed: Testbed, cluster: NetnsCluster
) -> None:
    c = cluster.clients
    with bed.cut_rack("a", "b"):
        for k in range(3):
            cluster.raw_save(k % 2, f"rack-cut-{k}", _files(10 + k, ("__0_0.distcp",)))
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:  # the listings as replication and heal go on
            assert_honest(cluster)
            time.sleep(0.3)
    for k in range(3):
        cluster.wait_state(f"rack-cut-{k}", "REPLICATED", timeout=60)
    assert_honest(cluster)
    assert c[0].get_checkpoint(NS, "rack-cut-2").checkpoint_id == "rack-cut-2"


def test_no_committed_checkpoint_is_lost_with_one_failure_domain_cut(
    bed: Testbed, cluster: NetnsCluster
) -> None:
    c = cluster.clients
    names = ("__0_0.distcp", "__1_0.distcp", ".metadata")
    saved = {}
    for k in range(3):
        files = {0: _files(20 + k, names[0::2]), 1: _files(30 + k, names[1:2])}
        save_ranks({0: c[0], 1: c[1]}, NS, f"domain-{k}", files)
        saved[f"domain-{k}"] = {**files[0], **files[1]}
    for checkpoint_id in saved:
        cluster.wait_state(checkpoint_id, "REPLICATED", timeout=60)
    # Rack a's cables pulled (n0, the coordinator, and n2): one failure domain = copies.
    with bed.cut_node(bed.nodes[0]), bed.cut_node(bed.nodes[2]):
        for checkpoint_id, expected in saved.items():
            for i in (1, 3):
                _restore(c[i], checkpoint_id, expected)
            # Cut off, n0 and n2 may list it COMMITTED (they see no other copy); nobody
            # may call it LOST.
            assert "LOST" not in _states(cluster, checkpoint_id)
        assert_honest(cluster)
    assert_honest(cluster)


def test_after_a_cut_heals_the_cluster_converges_within_a_few_heal_rounds(
    bed: Testbed, cluster: NetnsCluster
) -> None:
    c = cluster.clients
    ids = [f"converge-{k}" for k in range(3)]
    files = [_files(40 + k, ("__0_0.distcp", ".metadata")) for k in range(3)]
    with bed.cut_node(bed.nodes[0]):  # n0 saves alone: nobody to copy to, nobody told
        for checkpoint_id, named in zip(ids, files, strict=True):
            write_files(c[0], NS, checkpoint_id, named)
            c[0].commit_checkpoint(NS, checkpoint_id, named, holder_nodes=["n0"])
        for checkpoint_id in ids:
            assert _states(cluster, checkpoint_id)[0] == "COMMITTED"
        assert_honest(cluster)
    healed = time.monotonic()
    wait_until(
        "every checkpoint n0 saved alone REPLICATED on every node",
        lambda: all(_states(cluster, i) == ["REPLICATED"] * 4 for i in ids),
        60,
        interval=0.1,
    )
    seconds = time.monotonic() - healed
    rounds = math.ceil(seconds / HEAL_INTERVAL)
    print(f"converged {seconds:.2f} s after the heal: {rounds} heal rounds of {HEAL_INTERVAL} s")
    # The breaker skips a peer that missed calls during the cut for up to BACKOFF_CAP
    # seconds; convergence is bounded by that back-off and a few heal rounds after it.
    assert seconds <= BACKOFF_CAP + 5 * HEAL_INTERVAL, f"{seconds:.1f} s to converge"
    for i, client in enumerate(c):
        for checkpoint_id, named in zip(ids, files, strict=True):
            if i:
                _restore(client, checkpoint_id, named)
    assert_honest(cluster)


def test_a_frozen_peer_costs_a_restore_at_most_its_stall_timeout(
    bed: Testbed, cluster: NetnsCluster
) -> None:
    c = cluster.clients
    named = _files(50, ("__0_0.distcp", ".metadata"), size=4 << 20)
    cluster.raw_save(0, "frozen-owner", named)
    cluster.wait_state("frozen-owner", "REPLICATED", timeout=60)
    holders = cluster.holders("frozen-owner")
    buddies = {h for owner, *replicas in holders.values() for h in replicas}
    # Restore through a node holding no copy: every byte must come from a peer, the
    # owner frozen (its sockets open, nothing answered), its buddy serving.
    reader = next(i for i in (1, 2, 3) if f"n{i}" not in buddies)
    with bed.freeze(cluster.nodes[0].pid):
        took = _restore(c[reader], "frozen-owner", named)
        assert_honest_without(cluster, frozen=0)
    print(f"restore with the owner frozen: {took:.2f} s (fetch stall timeout {FETCH_STALL} s)")
    assert took <= FETCH_STALL, f"a restore took {took:.1f} s with a frozen peer"


def assert_honest_without(cluster: NetnsCluster, frozen: int) -> None:
    """`assert_honest` over the nodes that answer (a frozen one's call would time out)."""
    for i, client in enumerate(cluster.clients):
        if i == frozen:
            continue
        for info in client.list_checkpoints(NS):
            if info.state != "REPLICATED":
                continue
            for f in info.files:
                holders = [h for h in (f.owner_node, *f.replica_nodes) if h]
                present = [h for h in holders if _on_disk(cluster, h, info.checkpoint_id, f.name)]
                assert len(present) >= COPIES + 1, f"n{i}: {info.checkpoint_id}/{f.name}"
