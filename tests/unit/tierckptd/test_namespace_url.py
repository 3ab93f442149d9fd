"""Per-namespace persistent URLs: the grammar, the `[persistent] allowed_urls` policy
(whole segments, no path tricks), and a real catalog draining each checkpoint to the URL
it recorded at commit, through a restart (the manifest) and a peer (the published
manifest), never to one this node does not allow. S3 and real daemons:
tests/integration/test_namespace_url.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tierckpt.errors import InvalidName, NoPersistentTier, PermissionDenied, UnsafeMetadata
from tierckpt.names import check_persistent_url
from tierckptd.config import ConfigError, parse_config
from tierckptd.memory.manifest import ManifestError, from_json, to_json
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.roots import Roots
from tierckptd.persistent.store import PersistentTier, RetryPolicy
from tierckptd.wire import record_from_info, to_info

from tests.support.dcp_files import SavedCheckpoint, save_checkpoint

from .conftest import MakeCatalog
from .test_durable_hint import NS, _node, _save

FAST = RetryPolicy(max_attempts=2, deadline=None, base=0.01, cap=0.02)


@pytest.mark.parametrize(
    ("url", "normalized"),
    [
        ("s3://bucket/jobs/", "s3://bucket/jobs"),
        ("s3://bucket", "s3://bucket"),
        ("file:///srv/ckpt//", "file:///srv/ckpt"),
        ("http://minio:9000/b/p", "http://minio:9000/b/p"),
        ("", ""),
    ],
)
def test_urls_are_normalized(url: str, normalized: str) -> None:
    assert check_persistent_url(url) == normalized


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/../secret",
        "s3://bucket/jobs/./x",
        "s3://bucket//jobs",
        "s3://bucket/jobs?versionId=1",
        "s3://bucket/jobs#x",
        "s3://bucket/%2e%2e/x",
        "s3://user:pw@bucket/jobs",
        "s3://bucket/jo bs",
        "S3://bucket",
        "s3://",
        "/abs/path",
        "s3://b/" + "x" * 1100,
        "s3://bucket/jobs\n",
    ],
)
def test_malformed_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidName):
        check_persistent_url(url)


def _tier(root: Path) -> PersistentTier:
    return PersistentTier(f"file://{root}", retry=FAST)


def _stores(tmp_path: Path, *allowed: str) -> Roots:
    return Roots(_tier(tmp_path / "default"), allowed, _tier_from_url)


def _tier_from_url(url: str) -> PersistentTier:
    return PersistentTier(url, retry=FAST)


def test_allowed_urls_compare_whole_segments(tmp_path: Path) -> None:
    jobs = f"file://{tmp_path}/jobs"
    stores = _stores(tmp_path, jobs)
    assert stores.check(jobs) == jobs
    assert stores.check(jobs + "/team-a/") == jobs + "/team-a"
    assert stores.check(f"file://{tmp_path}/default") == ""  # the default's own URL
    assert stores.check("") == ""
    for refused in (f"file://{tmp_path}/jobs-evil", f"file://{tmp_path}", "s3://other/jobs"):
        with pytest.raises(PermissionDenied, match="allowed_urls"):
            stores.check(refused)
        assert stores.tier(refused) is None  # a manifest naming it resolves to no tier
    assert stores.tier(jobs + "/team-a") is stores.tier(jobs + "/team-a/")  # one root each
    assert stores.tier("") is stores.default


def test_config_normalizes_and_refuses_allowed_urls() -> None:
    cfg = parse_config({"persistent": {"allowed_urls": ["s3://b/jobs/", "file:///srv/x"]}})
    assert cfg.persistent.allowed_urls == ("s3://b/jobs", "file:///srv/x")
    with pytest.raises(ConfigError, match="allowed_urls"):
        parse_config({"persistent": {"allowed_urls": ["s3://b/../x"]}})
    with pytest.raises(ConfigError, match="allowed_urls"):
        parse_config({"persistent": {"allowed_urls": "s3://b/jobs"}})


@pytest.fixture
def saved(tmp_path: Path) -> SavedCheckpoint:
    return save_checkpoint(tmp_path / "hot")


def test_each_checkpoint_drains_to_the_url_it_was_committed_with(
    make_catalog: MakeCatalog, saved: SavedCheckpoint, tmp_path: Path
) -> None:
    jobs = f"file://{tmp_path}/jobs"
    stores = _stores(tmp_path, jobs)
    catalog = _node(make_catalog, every=1, keep_last=4)
    drainer = Drainer(catalog, stores, poll=0.01)
    _save(catalog, "step-1", saved)  # no namespace URL: the default
    catalog.durability.set_persistent_url(NS, stores.check(jobs + "/team-a"))
    _save(catalog, "step-2", saved)
    catalog.durability.set_persistent_url(NS, stores.check(jobs + "/team-b"))  # a later change...
    assert drainer.drain(NS, "step-1") and drainer.drain(NS, "step-2")
    assert (tmp_path / "default" / NS / "step-1" / ".metadata").is_file()
    # ...does not move step-2: it drains where it was committed to go.
    assert (tmp_path / "jobs" / "team-a" / NS / "step-2" / ".metadata").is_file()
    assert not (tmp_path / "jobs" / "team-b").exists()
    assert catalog.get(NS, "step-2").persistent_url == jobs + "/team-a"

    # The URL survives a restart (the manifest) and travels to peers (the published one).
    rec = from_json(catalog.manifest_document(NS, "step-2"))
    assert rec.persistent_url == jobs + "/team-a"
    assert record_from_info(to_info(catalog.get(NS, "step-2"))).persistent_url == rec.persistent_url
    doc = to_json(rec)
    doc["persistent_url"] = "s3://b/../x"
    with pytest.raises(ManifestError):
        from_json(doc)


def test_a_url_this_node_does_not_allow_is_refused_not_drained(
    make_catalog: MakeCatalog, saved: SavedCheckpoint, tmp_path: Path
) -> None:
    """A peer's manifest naming a URL outside this node's allowed_urls: the drain refuses
    it (drain-failed, no longer due, nothing written), it never writes there."""
    catalog = _node(make_catalog, every=1, keep_last=4)
    drainer = Drainer(catalog, _stores(tmp_path, f"file://{tmp_path}/jobs"), poll=0.01)
    catalog.durability.set_persistent_url(NS, f"file://{tmp_path}/elsewhere")  # as a peer's would
    _save(catalog, "step-1", saved)
    with pytest.raises(UnsafeMetadata, match="does not have or allow"):
        drainer.drain(NS, "step-1")
    assert catalog.durability.drain_failed().get((NS, "step-1")) is True
    assert catalog.due_not_durable() == []
    assert not (tmp_path / "elsewhere").exists()


def test_durable_hint_needs_a_tier_for_the_namespace(
    make_catalog: MakeCatalog, saved: SavedCheckpoint, tmp_path: Path
) -> None:
    # allowed_urls only, no [persistent] url
    catalog = make_catalog(
        budget=64 << 20, memory_keep_last=4, drain_every=1, default_persistent=False
    )
    with pytest.raises(NoPersistentTier, match="allowed_urls"):
        _save(catalog, "step-1", saved, durable=True)
    catalog.abort(NS, "step-1")
    catalog.durability.set_persistent_url(NS, f"file://{tmp_path}/jobs/a")
    _save(catalog, "step-2", saved, durable=True)
    assert catalog.due_not_durable() == [(NS, "step-2")]
