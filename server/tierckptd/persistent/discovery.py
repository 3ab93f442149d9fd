"""The persistent tier as a live source of checkpoints (not only at start).

Another cluster may drain into the same bucket and namespace while this daemon runs.
`Discovery` lets this node learn such checkpoints when it is asked for them:

- `probe(namespace, id)`: an explicit id the catalog does not know. One HEAD of
  ``<url>/<ns>/<id>/.metadata``; if the checkpoint is durable its manifest is adopted
  from the bookkeeping (`adopt_checkpoint`), with no file held here: files come from
  S3 on demand through the restore chain. Names are validated first, and a negative
  answer is cached for `negative_ttl` seconds (at most `max_negative` entries), so a
  loop of bad ids costs one request per id and TTL, not one per call.
- `refresh(namespace)`: before answering "the newest" or a listing, re-list the
  namespace when this node's view of it is older than `relist_interval`; an outage
  only logs (the memory tier's answer stands).

Listing never walks delimiter listings deeper than one level. Each durable checkpoint
has an index entry, an empty object ``<url>/<ns>/.tierckpt/durable/<id>`` written by
the drain right after `.metadata` and removed by the persistent retention before the
checkpoint goes, so the index is one flat prefix listing. One entry per checkpoint,
rather than one index document per namespace, means clusters that commit concurrently
never overwrite each other's entries. A namespace without entries (drained before the
index existed) falls back to a flat prefix scan of the namespace, keeping the
``<id>/.metadata`` keys. Nothing listed is trusted: names are validated, the number of
entries is capped, and each manifest adopted is range-checked (`check_stored_record`).

The catalog never imports this module: the rpc layer calls it (`DaemonService`), and
main.py wires it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from tierckpt.errors import TIER_UNAVAILABLE_PREFIX, TierckptError, TierUnavailable
from tierckpt.names import METADATA_FILE, check_checkpoint_id, check_namespace, is_checkpoint_id

from tierckptd.catalog import Catalog
from tierckptd.config_secrets import redact
from tierckptd.memory.manifest import ManifestError
from tierckptd.memory.manifest import from_json as manifest_from_json
from tierckptd.model import Key
from tierckptd.persistent.readback import check_stored_record
from tierckptd.persistent.source import describe_failure, tier_label
from tierckptd.persistent.store import PersistentTier, PersistentTierUnavailable
from tierckptd.persistent.stores import Stores

__all__ = [
    "INDEX_DIR",
    "MANIFEST_OBJECT",
    "MAX_INDEX_ENTRIES",
    "Discovery",
    "adopt_all",
    "adopt_checkpoint",
    "durable_ids",
    "remove_index_entry",
    "repair_index",
    "write_index_entry",
]

logger = logging.getLogger(__name__)

MANIFEST_OBJECT = "manifest.json"  # the checkpoint's manifest, in the bookkeeping area
MAX_MANIFEST = 64 << 20  # a bookkeeping manifest larger than this is refused unread
INDEX_DIR = ".tierckpt/durable"  # under <url>/<ns>/: one empty object per durable id
MAX_INDEX_ENTRIES = 1 << 20


# ---- the index ------------------------------------------------------------------------


def _index_dir(tier: PersistentTier, namespace: str) -> str:
    check_namespace(namespace)
    return f"{tier.root}/{namespace}/{INDEX_DIR}"


def write_index_entry(tier: PersistentTier, namespace: str, checkpoint_id: str) -> None:
    """Record a durable checkpoint in the namespace's index (after its `.metadata`)."""
    path = f"{_index_dir(tier, namespace)}/{check_checkpoint_id(checkpoint_id)}"
    tier.retrying(lambda: tier.put_object(path, b""), f"index {namespace}/{checkpoint_id}")


def remove_index_entry(tier: PersistentTier, namespace: str, checkpoint_id: str) -> None:
    """Drop a checkpoint from the index (before it is deleted)."""
    path = f"{_index_dir(tier, namespace)}/{check_checkpoint_id(checkpoint_id)}"
    tier.retrying(lambda: tier.remove_object(path), f"unindex {namespace}/{checkpoint_id}")


def _valid_ids(names: list[str], where: str) -> set[str]:
    ids = {n for n in names if is_checkpoint_id(n)}
    if len(ids) < len(names):
        logger.warning("%s: skipped %d invalid name(s)", where, len(set(names)) - len(ids))
    if len(ids) > MAX_INDEX_ENTRIES:
        logger.warning("%s: %d entries, only %d read", where, len(ids), MAX_INDEX_ENTRIES)
        ids = set(sorted(ids)[:MAX_INDEX_ENTRIES])
    return ids


def _flat_scan(tier: PersistentTier, prefix: str) -> list[str]:
    def scan() -> list[str]:
        tier.fs.invalidate_cache(prefix)
        try:
            return [str(p) for p in tier.find(prefix)]
        except FileNotFoundError:
            return []

    return tier.retrying(scan, f"list {prefix}")


def _indexed_ids(tier: PersistentTier, namespace: str) -> set[str]:
    index = _index_dir(tier, namespace)
    names = [p.rsplit("/", 1)[-1] for p in _flat_scan(tier, index)]
    return _valid_ids(names, f"{namespace} index")


def repair_index(tier: PersistentTier, namespace: str, durable: set[str]) -> int:
    """Write the index entries that `durable` (a full scan's ids: `.metadata` keys) has and
    the index lacks: a drain cut off by a kill -9 between `.metadata` and its entry, or a
    namespace drained before the index existed. Only from a complete scan, so an index
    once started lists every durable checkpoint. Returns entries written; an outage or a
    refused write only warns (the entries are hints for discovery)."""
    try:
        missing = sorted(durable - _indexed_ids(tier, namespace))
        for checkpoint_id in missing:
            write_index_entry(tier, namespace, checkpoint_id)
    except (PersistentTierUnavailable, OSError) as e:
        logger.warning("%s: durable index not repaired: %s", namespace, e)
        return 0
    if missing:
        logger.info("%s: wrote %d missing durable index entries", namespace, len(missing))
    return len(missing)


def durable_ids(tier: PersistentTier, namespace: str, *, scan: bool = False) -> set[str]:
    """Ids of the namespace's durable checkpoints, as listed. Without `scan` the index
    entries (a hint: `.metadata` is checked before one is trusted), or the flat prefix
    scan when there are none; with `scan` only the scan (its ``<id>/.metadata`` keys)."""
    if not scan:
        ids = _indexed_ids(tier, namespace)
        if ids:
            return ids
    base = f"{tier.root}/{namespace}/"
    found = [
        parts[0]
        for p in _flat_scan(tier, base.rstrip("/"))
        if p.startswith(base)
        and len(parts := p[len(base) :].split("/")) == 2
        and parts[1] == METADATA_FILE
    ]
    return _valid_ids(found, namespace)


# ---- adoption -------------------------------------------------------------------------


def adopt_checkpoint(
    tier: PersistentTier, catalog: Catalog, key: Key, known: set[Key], url: str = ""
) -> int:
    """Adopt one durable checkpoint from its bookkeeping manifest (no file held here);
    1 if the catalog learnt it, 0 if it knew it (now marked durable) or cannot. `url` is
    what the record keeps as its persistent URL (`Stores.url_of(tier)`): where it was
    found, not what the stored manifest claims.

    Raises:
        PersistentTierUnavailable: an outage.
        ManifestError, ValueError: the stored manifest is refused.
    """
    if key in known:
        catalog.mark_durable(*key)
        return 0
    raw = tier.read_bookkeeping(*key, MANIFEST_OBJECT, max_bytes=MAX_MANIFEST)
    if raw is None:
        logger.warning("%s/%s is durable but has no manifest; skipped", *key)
        return 0
    rec = manifest_from_json(json.loads(raw))
    if rec.key != key:
        raise ManifestError(f"the manifest describes {rec.namespace}/{rec.checkpoint_id}")
    check_stored_record(rec, time.time())
    rec.persistent_url = url
    for f in rec.files.values():
        f.held = False
        f.owner_node = ""
        f.replica_nodes = []
    if not catalog.publish(rec, durable=True):
        return 0
    catalog.mark_durable(*key)
    return 1


def _adopt_ids(
    tier: PersistentTier,
    catalog: Catalog,
    namespace: str,
    ids: set[str],
    *,
    verified: bool,
    url: str = "",
) -> int:
    adopted = 0
    known = set(catalog.committed_keys())
    for checkpoint_id in sorted(ids):
        key = (namespace, checkpoint_id)
        if key in known and catalog.is_durable(*key):
            continue  # nothing to learn
        try:
            # A listing is a hint (an index entry may outlive a .metadata deleted by
            # hand): only the commit marker makes a checkpoint durable.
            if verified or tier.is_durable(*key):
                adopted += adopt_checkpoint(tier, catalog, key, known, url)
        except PersistentTierUnavailable:
            raise
        except Exception as e:
            logger.error(
                "%s/%s: not adopted from the persistent tier: %s: %.300s",
                *key,
                type(e).__name__,
                e,
            )
    return adopted


def adopt_all(tier: PersistentTier, catalog: Catalog, url: str = "") -> int:
    """Every durable checkpoint of every namespace in `tier` (a replacement cluster at
    start); `url` as in `adopt_checkpoint`.

    Raises:
        PersistentTierUnavailable: an outage.
    """
    adopted = 0
    for namespace in tier.list_namespaces():
        ids = durable_ids(tier, namespace, scan=True)  # .metadata keys: verified
        repair_index(tier, namespace, ids)
        adopted += _adopt_ids(tier, catalog, namespace, ids, verified=True, url=url)
    if adopted:
        logger.info("adopted %d durable checkpoints from %s", adopted, redact(tier.url))
    return adopted


# ---- live discovery -------------------------------------------------------------------


class Discovery:
    """Learns checkpoints other clusters drained, when they are asked for (module doc).

    A namespace is looked up in the tier its next commit would drain to (its own URL,
    else ``[persistent] url``); "every namespace" lists the default tier's.

    Args:
        stores: the daemon's persistent tiers (a bare tier: that one only).
        relist_interval: how old this node's view of a namespace may be before `refresh`
            lists it again (seconds; 0: every time).
        negative_ttl: how long "not durable" answers of `probe` are remembered.
        max_negative: how many such answers are remembered at most.
    """

    def __init__(
        self,
        stores: Stores | PersistentTier,
        catalog: Catalog,
        *,
        relist_interval: float = 30.0,
        negative_ttl: float = 10.0,
        max_negative: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stores = stores if isinstance(stores, Stores) else Stores(stores)
        self.catalog = catalog
        self.relist_interval = relist_interval
        self.negative_ttl = negative_ttl
        self.max_negative = max_negative
        self._clock = clock
        self._lock = threading.Lock()  # one S3 listing at a time
        # (namespace, its URL) -> when listed; ("", "") is every namespace of the default.
        self._listed: dict[tuple[str, str], float] = {}
        self._negative: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        self._neg_lock = threading.Lock()
        self.probes = 0  # remote probes made (tests)

    def _tier_of(self, namespace: str) -> tuple[PersistentTier | None, str]:
        url = self.catalog.persistent_url(namespace)
        return self.stores.tier(url), url

    def _unavailable(self, tier: PersistentTier, what: str, e: BaseException) -> TierUnavailable:
        cause = describe_failure(e)
        return TierUnavailable(
            f"{TIER_UNAVAILABLE_PREFIX}{tier_label(tier.url)}: {what} could not be looked up "
            f"in the persistent tier ({cause}); retry once it is reachable"
        )

    def _negative_hit(self, key: tuple[str, str, str]) -> bool:
        now = self._clock()
        with self._neg_lock:
            until = self._negative.get(key)
            if until is None:
                return False
            if until > now:
                return True
            del self._negative[key]
            return False

    def _remember_missing(self, key: tuple[str, str, str]) -> None:
        with self._neg_lock:
            self._negative[key] = self._clock() + self.negative_ttl
            self._negative.move_to_end(key)
            while len(self._negative) > self.max_negative:
                self._negative.popitem(last=False)

    def probe(self, namespace: str, checkpoint_id: str) -> bool:
        """Whether a checkpoint the catalog does not know was found durable and adopted.

        Raises:
            InvalidName: a bad namespace or id (nothing is asked).
            TierUnavailable: the persistent tier could not be asked.
        """
        key = (check_namespace(namespace), check_checkpoint_id(checkpoint_id))
        tier, url = self._tier_of(namespace)
        if tier is None:
            return False
        negative = (*key, url)
        if self._negative_hit(negative):
            return False
        what = f"checkpoint {namespace}/{checkpoint_id}"
        self.probes += 1
        try:
            if not tier.is_durable(*key):
                self._remember_missing(negative)
                return False
            known = set(self.catalog.committed_keys())
            adopted = adopt_checkpoint(tier, self.catalog, key, known, url)
        except TierckptError:
            raise
        except OSError as e:  # PersistentTierUnavailable, 403 (PermissionError), ...
            raise self._unavailable(tier, what, e) from None
        except (ManifestError, ValueError) as e:
            logger.error("%s: not adopted from the persistent tier: %.300s", what, e)
            self._remember_missing(negative)
            return False
        if adopted:
            logger.info("adopted %s from %s (asked for it)", what, tier_label(tier.url))
        elif key not in known:
            self._remember_missing(negative)
            return False
        return True

    def _forget_deleted(
        self, tier: PersistentTier, namespace: str, ids: set[str], url: str
    ) -> None:
        """Drop what this node lists as held only in `tier` but the listing no longer
        shows and `.metadata` confirms gone: another node's persistent retention (or an
        operator) deleted it, and a listing must not offer what cannot be restored."""
        for checkpoint_id in self.catalog.persistent_only(namespace, url):
            if checkpoint_id not in ids and not tier.is_durable(namespace, checkpoint_id):
                self.catalog.forget_persistent(namespace, checkpoint_id)
                logger.info(
                    "%s/%s is gone from %s: no longer listed here",
                    namespace,
                    checkpoint_id,
                    tier_label(tier.url),
                )

    def mark_listed(self, namespace: str = "") -> None:
        """This node's view of `namespace` ("": every namespace) is fresh now."""
        url = self.catalog.persistent_url(namespace) if namespace else ""
        with self._lock:
            self._listed[(namespace, url)] = self._clock()

    def refresh(self, namespace: str = "", max_age: float | None = None) -> int:
        """Re-list `namespace` ("": every namespace) when this node's view is older than
        `max_age` (default `relist_interval`); returns checkpoints adopted. An outage is
        logged, not raised: the caller answers from what this node knows. A namespace
        that changed its URL is listed afresh in the new one."""
        if namespace:
            check_namespace(namespace)
        tier, url = self._tier_of(namespace) if namespace else (self.stores.default, "")
        if tier is None:
            return 0
        age = self.relist_interval if max_age is None else max_age
        with self._lock:
            now = self._clock()
            last = self._listed.get((namespace, url), -1e18)
            if not url:
                last = max(last, self._listed.get(("", ""), -1e18))
            if now - last < age:
                return 0
            try:
                adopted = 0
                for ns in [namespace] if namespace else tier.list_namespaces():
                    ids = durable_ids(tier, ns)
                    adopted += _adopt_ids(tier, self.catalog, ns, ids, verified=False, url=url)
                    self._forget_deleted(tier, ns, ids, url)
            except OSError as e:  # an outage, a 403: answer from what this node knows
                logger.warning(
                    "cannot re-list %s in %s: %s",
                    namespace or "the namespaces",
                    tier_label(tier.url),
                    e,
                )
                adopted = 0
            self._listed[(namespace, url)] = self._clock()  # failed too: no hammering
        if adopted:
            logger.info(
                "adopted %d checkpoint(s) from %s (re-listed)", adopted, tier_label(tier.url)
            )
        return adopted
