"""Who drains what (`persistent.drain_plan`), and a Drainer holding only a buddy's copies:
a real catalog (the copies installed as a peer's push would), a `file://` tier, and the
peers' answers given as data (the daemons' version: tests/integration/test_drain_replica.py).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from tierckpt.checksum import checksum_bytes
from tierckptd.catalog import Catalog
from tierckptd.config import ConfigError, load_config
from tierckptd.memory.incoming import install_copy
from tierckptd.model import CheckpointRecord, FileRecord, State
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.drain_plan import (
    Liveness,
    PeerHolding,
    Peers,
    Presence,
    committer,
    plan_drain,
    uploader,
)
from tierckptd.persistent.store import PersistentTier

from tests.support.dcp_files import SavedCheckpoint, assert_state_equal, load_target
from tests.support.dcp_files import save_checkpoint as stock_save

from .conftest import MakeCatalog
from .test_durable_hint import FAST, NS

META = ".metadata"


def _f(name: str, owner: str, replicas: tuple[str, ...] = (), held: bool = False) -> FileRecord:
    return FileRecord(
        name, 0, 1, checksum_bytes(b"x"), owner_node=owner, replica_nodes=list(replicas), held=held
    )


def _holds(*names: str, known: bool = True) -> PeerHolding:
    return PeerHolding(known, frozenset(names))


# ---- the pure rule ------------------------------------------------------------------------


def test_the_owner_uploads_while_it_holds_the_file_or_may_come_back() -> None:
    f = _f("a.distcp", "n1", ("n2", "n3"))
    me = "n2"
    mine = _f("a.distcp", "n1", ("n2", "n3"), held=True)
    assert uploader(mine, Presence(me, {"n1": _holds("a.distcp"), "n3": _holds()})) == "n1"
    # Unreachable but within its grace: presumed present, the replicas wait for it.
    assert uploader(mine, Presence(me, {"n1": None, "n3": _holds()})) == "n1"
    # Gone (past the grace), answered without the file, or no longer a member.
    assert uploader(mine, Presence(me, {"n1": None, "n3": _holds()}, frozenset({"n1"}))) == me
    assert uploader(mine, Presence(me, {"n1": _holds(), "n3": _holds()})) == me
    assert uploader(mine, Presence(me, {"n3": _holds("a.distcp")})) == me
    # The first live holder in replica order: n2 before n3, whoever asks.
    both = {"n1": _holds(), "n2": _holds("a.distcp"), "n3": _holds("a.distcp")}
    from_n3 = {k: v for k, v in both.items() if k != "n3"}
    assert uploader(_f("a.distcp", "n1", ("n2", "n3"), held=True), Presence("n3", from_n3)) == "n2"
    assert uploader(_f("a.distcp", "n1", ("n2", "n3")), Presence("n1", both)) == "n2"
    # Nobody live holds it: no uploader (the checkpoint cannot become durable).
    assert uploader(f, Presence("n1", {"n2": _holds(), "n3": _holds()})) == ""


def test_a_holder_missing_from_the_replica_list_comes_after_it_by_id() -> None:
    f = _f("a.distcp", "n1", ("n4",))
    peers: Peers = {"n1": _holds(), "n3": _holds("a.distcp"), "n4": _holds()}
    mine = _f("a.distcp", "n1", ("n4",), held=True)
    assert uploader(mine, Presence("n2", peers)) == "n2"
    assert uploader(f, Presence("n5", peers)) == "n3"


def test_without_peer_information_each_node_drains_its_own_files() -> None:
    assert uploader(_f("a", "n1", held=True), Presence("n1")) == "n1"
    assert uploader(_f("a", "n1", ("n2",), held=True), Presence("n2")) == "n1"
    assert uploader(_f("a", "n1"), Presence("n1")) == ""  # not held: nothing to upload
    assert committer(_f(META, "n1"), Presence("n1")) == "n1"
    assert committer(_f(META, "n1", ("n2",), held=True), Presence("n2")) == "n1"
    assert committer(_f(META, "", held=True), Presence("n2")) == "n2"  # no owner recorded


def test_the_coordinator_commits_until_it_is_gone() -> None:
    meta = _f(META, "n1", ("n2", "n3"), held=True)
    # The coordinator commits even without its copy: it restores .metadata from a peer.
    assert committer(_f(META, "n1"), Presence("n1", {"n2": _holds(META)})) == "n1"
    assert committer(meta, Presence("n2", {"n1": _holds(), "n3": _holds(META)})) == "n1"
    assert committer(meta, Presence("n2", {"n1": None, "n3": _holds(META)})) == "n1"
    gone = Presence("n2", {"n1": None, "n3": _holds(META)}, frozenset({"n1"}))
    assert committer(meta, gone) == "n2"
    # A replacement that does not know the checkpoint is gone as a coordinator too.
    assert committer(meta, Presence("n3", {"n1": _holds(known=False), "n2": _holds(META)})) == (
        "n2"
    )
    assert committer(meta, Presence("n2", {"n3": _holds(META)})) == "n2"  # not a member


def test_a_plan_uploads_what_this_node_must_and_waits_for_the_rest() -> None:
    files = [
        _f("own.distcp", "n2", ("n1",), held=True),
        _f("theirs.distcp", "n1", ("n2",), held=True),
        _f("lost.distcp", "n3"),
        _f(META, "n1", ("n2",), held=True),
    ]
    pending = ["own.distcp", "theirs.distcp", "lost.distcp"]
    alive = Presence("n2", {"n1": _holds("theirs.distcp", META), "n3": _holds()})
    plan = plan_drain(files, pending, alive)
    assert plan.upload == ("own.distcp",) and plan.waiting == ("theirs.distcp",)
    assert plan.unheld == ("lost.distcp",) and not plan.commit
    gone = Presence("n2", {"n1": None, "n3": _holds()}, frozenset({"n1"}))
    plan = plan_drain(files, pending, gone)
    assert plan.upload == ("own.distcp", "theirs.distcp") and plan.commit and plan.by_rule
    # SIGTERM: everything held here, and a commit attempt since .metadata is held here.
    plan = plan_drain(files, pending, Presence("n2"), everything=True)
    assert plan.upload == ("own.distcp", "theirs.distcp") and plan.commit
    assert not plan.by_rule
    assert plan_drain(files, [], alive).upload == ()  # all up: nothing to upload


def test_liveness_counts_the_grace_from_the_first_miss_and_forgets_on_an_answer() -> None:
    now = [100.0]
    live = Liveness(5.0, clock=lambda: now[0])
    assert live.observe({"n1": None, "n2": _holds()}) == frozenset()
    now[0] = 104.0
    assert live.observe({"n1": None, "n2": None}) == frozenset()
    now[0] = 105.0
    assert live.observe({"n1": None, "n2": None}) == {"n1"}
    assert live.observe({"n1": _holds(), "n2": None}) == frozenset()
    now[0] = 200.0
    assert live.observe({"n1": None}) == frozenset()  # n2 not asked: its clock runs on
    assert live.observe({"n1": None, "n2": None}) == {"n2"}


# ---- a node holding only a buddy's copies -------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> PersistentTier:
    return PersistentTier(f"file://{tmp_path / 'store'}", retry=FAST)


def _buddy(make_catalog: MakeCatalog, saved: SavedCheckpoint, cid: str) -> Catalog:
    """node-b, holding a copy of every file of node-a's checkpoint `cid`."""
    node = make_catalog(node_id="node-b", budget=64 << 20, memory_keep_last=4, drain_every=1)
    names = [*saved.data_names, META]
    data = {n: (saved.directory / n).read_bytes() for n in names}
    files = {
        n: FileRecord(n, 0, len(d), checksum_bytes(d), owner_node="node-a", held=False)
        for n, d in data.items()
    }
    now = time.time()
    record = CheckpointRecord(NS, cid, State.COMMITTED, now, "node-a", now, 1, files=files)
    assert node.publish(record)
    for n, d in data.items():
        assert install_copy(node, NS, cid, node.file_view(NS, cid, n)[0], [(0, d)], what=n)
    return node


def test_a_buddy_waits_for_a_live_owner_then_drains_and_commits_once_it_is_gone(
    make_catalog: MakeCatalog, store: PersistentTier, tmp_path: Path
) -> None:
    saved = stock_save(tmp_path / "hot", thread_count=2)
    node = _buddy(make_catalog, saved, "step-1")
    answers: dict[str, PeerHolding | None] = {
        "node-a": _holds(*saved.data_names, META),
        "node-c": _holds(),
    }
    asked: list[tuple[str, list[str]]] = []

    def peers(namespace: str, checkpoint_id: str, nodes: Collection[str]) -> Peers:
        asked.append((checkpoint_id, sorted(nodes)))
        return {n: answers[n] for n in nodes if n in answers}

    drainer = Drainer(node, store, peers=peers, owner_grace=0.0)
    assert not drainer.drain(NS, "step-1")  # the owner holds its files: it uploads them
    assert asked == [("step-1", ["node-a"])]  # only the owner is asked about its files
    assert store.uploaded(NS, "step-1") == {}
    answers["node-a"] = None  # killed; a grace of 0: gone at once
    assert drainer.drain(NS, "step-1")
    assert node.durability.is_durable(NS, "step-1") and store.is_durable(NS, "step-1")
    target = load_target(saved.state)
    dcp.load(target, checkpoint_id=store.checkpoint_url(NS, "step-1"))
    assert_state_equal(actual=target, expected=saved.state)


def test_a_buddy_uploads_for_an_empty_replacement_which_commits(
    make_catalog: MakeCatalog, store: PersistentTier, tmp_path: Path
) -> None:
    saved = stock_save(tmp_path / "hot")
    node = _buddy(make_catalog, saved, "step-2")
    empty = {"node-a": _holds()}  # came back without its memory: knows it, holds nothing
    drainer = Drainer(node, store, peers=lambda *_: empty, owner_grace=3600.0)
    assert not drainer.drain(NS, "step-2")  # uploaded node-a's files; node-a commits
    assert set(store.uploaded(NS, "step-2")) == set(saved.data_names)
    assert not store.is_durable(NS, "step-2")


def test_sigterm_drains_a_buddys_copies_without_asking_anyone(
    make_catalog: MakeCatalog, store: PersistentTier, tmp_path: Path
) -> None:
    saved = stock_save(tmp_path / "hot")
    node = _buddy(make_catalog, saved, "step-3")

    def peers(namespace: str, checkpoint_id: str, nodes: Collection[str]) -> Peers:
        raise AssertionError("SIGTERM's drain does not wait for the peers")

    assert Drainer(node, store, peers=peers).emergency(deadline=30.0)
    assert store.list_durable(NS) == ["step-3"]
    target = load_target(saved.state)
    dcp.load(target, checkpoint_id=store.checkpoint_url(NS, "step-3"))
    assert_state_equal(actual=target, expected=saved.state)


@pytest.mark.parametrize("value", ["-1.0", "nan", "inf"])
def test_owner_grace_must_be_finite_and_not_negative(tmp_path: Path, value: str) -> None:
    path = tmp_path / "tierckptd.toml"
    path.write_text(f"[persistent]\nowner_grace = {value}\n")
    with pytest.raises(ConfigError, match="owner_grace"):
        load_config(path)
    path.write_text("[persistent]\nowner_grace = 2.5\n")
    assert load_config(path).persistent.owner_grace == 2.5


@pytest.mark.parametrize("value", ["0.1", "nan", "inf"])
def test_retry_max_must_be_finite_and_at_least_the_first_wait(tmp_path: Path, value: str) -> None:
    path = tmp_path / "tierckptd.toml"
    path.write_text(f"[persistent]\nretry_max = {value}\n")
    with pytest.raises(ConfigError, match="retry_max"):
        load_config(path)
    path.write_text("[persistent]\nretry_max = 2.0\n")
    assert load_config(path).persistent.retry_max == 2.0


def test_sigterm_skips_a_lost_newest_and_drains_the_one_before(
    make_catalog: MakeCatalog, store: PersistentTier, tmp_path: Path
) -> None:
    saved = stock_save(tmp_path / "hot")
    node = _buddy(make_catalog, saved, "step-4")
    files = {n: (saved.directory / n).read_bytes() for n in [*saved.data_names, META]}
    record = CheckpointRecord(
        NS,
        "step-5",
        State.COMMITTED,
        time.time(),
        "node-a",
        time.time(),
        2,
        files={
            n: FileRecord(n, 0, len(d), checksum_bytes(d), owner_node="node-a", held=False)
            for n, d in files.items()
        },
    )
    assert node.publish(record)
    name = saved.data_names[0]
    f = node.file_view(NS, "step-5", name)[0]
    install_copy(node, NS, "step-5", f, [(0, files[name])], what=name)
    node.set_health(NS, "step-5", "lost", [META])  # the healer found no copy of .metadata
    assert node.get(NS, "step-5").state is State.LOST
    assert Drainer(node, store).emergency(deadline=30.0)
    assert store.list_durable(NS) == ["step-4"]
    assert store.uploaded(NS, "step-5") == {}
