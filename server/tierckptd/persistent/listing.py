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
  namespace when this node's view of it is older than `relist_interval`. The listing
  runs on Discovery's own worker threads, one at a time per namespace (callers that
  ask meanwhile join it), under a deadline (`LISTING_DEADLINE`); the RPC waits for it
  at most `wait` seconds and then answers from the catalog. An outage only logs (the
  memory tier's answer stands): an S3 endpoint that accepts connections and never
  answers costs a listing its deadline, never the control socket's threads (audit 3
  H7). A probe runs on the caller's thread, bounded by `PROBE_DEADLINE`.

Listing never walks delimiter listings deeper than one level. Each durable checkpoint
has an index entry, an empty object ``<url>/<ns>/.tierckpt/durable/<id>`` written by
the drain right after `.metadata` and removed by the persistent retention before the
checkpoint goes, so the index is one flat prefix listing (an id that is a folder path is
spelled flat there, ``run1+step-10``: `tierckpt.names.flat_checkpoint_id`). One entry per
checkpoint, rather than one index document per namespace, means clusters that commit
concurrently never overwrite each other's entries. A namespace without entries (drained
before the index existed) falls back to a flat prefix scan of the namespace, keeping the
``<id>/.metadata`` keys at any depth (``run1/step-10/.metadata``: a folder is a
checkpoint iff it holds ``.metadata``). Nothing listed is trusted: names are validated,
the number of entries is capped, and each manifest adopted is range-checked
(`check_stored_record`).

At start (`adopt_all`, after READY, in the background, under a time budget) a namespace
is adopted from its index only; the scan runs for a namespace without one, and an entry
is written only for an id whose bookkeeping manifest parses and names it: junk
``<id>/.metadata`` keys in a shared bucket cost a listing, never an entry, a request or
a log line each (audit 3 M7).

The catalog never imports this module: the rpc layer calls it (`DaemonService`), and
main.py wires it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext

from tierckpt.errors import TIER_UNAVAILABLE_PREFIX, InvalidName, TierckptError, TierUnavailable
from tierckpt.names import (
    FORMAT_FILES,
    check_checkpoint_id,
    check_namespace,
    checkpoint_id_of_flat,
    flat_checkpoint_id,
)

from tierckptd.catalog import Catalog
from tierckptd.config_secrets import redact
from tierckptd.memory.manifest import ManifestError
from tierckptd.memory.manifest import from_json as manifest_from_json
from tierckptd.model import Key
from tierckptd.persistent.errors import tier_label
from tierckptd.persistent.files_commit import FILES_COMMIT_OBJECT, MAX_COMMIT, check_matches
from tierckptd.persistent.files_commit import parse as parse_files_commit
from tierckptd.persistent.roots import Roots
from tierckptd.persistent.store import Op, PersistentTier, PersistentTierUnavailable, metadata_ids
from tierckptd.persistent.trust_marker import read_trust
from tierckptd.persistent.untrusted import check_stored_record

__all__ = [
    "ADOPT_BUDGET",
    "INDEX_DIR",
    "LISTING_DEADLINE",
    "LISTING_WAIT",
    "PROBE_DEADLINE",
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
LISTING_WAIT = 3.0  # an RPC waits this long for a fresh listing, then answers from the catalog
LISTING_DEADLINE = 30.0  # one background listing (every call in it) gives up after this
PROBE_DEADLINE = 10.0  # an explicit id's probe, on the RPC's thread
ADOPT_BUDGET = 300.0  # the start-up adoption of one root; the rest is learnt when asked
ADOPT_WORKERS = 4  # namespaces adopted at once at start
RELIST_WORKERS = 4  # background listings at once
MAX_FLIGHTS = 4096  # listings queued at once; beyond, a refresh answers from the catalog


# ---- the index ------------------------------------------------------------------------


def _index_dir(tier: PersistentTier, namespace: str) -> str:
    check_namespace(namespace)
    return f"{tier.root}/{namespace}/{INDEX_DIR}"


def write_index_entry(tier: PersistentTier, namespace: str, checkpoint_id: str) -> None:
    """Record a durable checkpoint in the namespace's index (after its `.metadata`)."""
    path = f"{_index_dir(tier, namespace)}/{flat_checkpoint_id(checkpoint_id)}"
    tier.retrying(
        lambda: tier.put_object(path, b""), f"index {namespace}/{checkpoint_id}", Op.UPLOAD
    )


def remove_index_entry(tier: PersistentTier, namespace: str, checkpoint_id: str) -> None:
    """Drop a checkpoint from the index (before it is deleted)."""
    path = f"{_index_dir(tier, namespace)}/{flat_checkpoint_id(checkpoint_id)}"
    tier.retrying(
        lambda: tier.remove_object(path), f"unindex {namespace}/{checkpoint_id}", Op.DELETE
    )


def _valid_ids(names: list[str], where: str, *, flat: bool = False) -> set[str]:
    """The valid ids among `names` (index entries spell them flat)."""
    ids: set[str] = set()
    for n in names:
        try:
            ids.add(checkpoint_id_of_flat(n) if flat else check_checkpoint_id(n))
        except InvalidName:
            continue
    if len(ids) < len(set(names)):
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

    return tier.retrying(scan, f"list {prefix}", Op.LIST)


def _indexed_ids(tier: PersistentTier, namespace: str) -> set[str]:
    index = _index_dir(tier, namespace)
    names = [p.rsplit("/", 1)[-1] for p in _flat_scan(tier, index)]
    return _valid_ids(names, f"{namespace} index", flat=True)


def _bookkept_ids(tier: PersistentTier, namespace: str) -> set[str]:
    """Ids with a bookkeeping directory: ids that only have a junk ``.metadata`` cost
    nothing more than this one delimiter listing."""
    return tier.bookkept_ids(namespace)


def _manifest_parses(tier: PersistentTier, key: Key) -> bool:
    """Whether the checkpoint's bookkeeping manifest is there, parses, names `key` and
    passes the range checks (a refusal is logged at debug: junk is summarized).

    Raises:
        PersistentTierUnavailable: an outage.
    """
    try:
        raw = tier.read_bookkeeping(*key, MANIFEST_OBJECT, max_bytes=MAX_MANIFEST)
        if raw is None:
            return False
        rec = manifest_from_json(json.loads(raw))
        if rec.key != key:
            raise ManifestError(f"the manifest describes {rec.namespace}/{rec.checkpoint_id}")
        check_stored_record(rec, time.time())
    except PersistentTierUnavailable:
        raise
    except (ManifestError, ValueError, TypeError, KeyError) as e:
        logger.debug("%s/%s: stored manifest refused: %.300s", *key, e)
        return False
    return True


def repair_index(
    tier: PersistentTier, namespace: str, durable: set[str], until: float | None = None
) -> int:
    """Write the index entries that `durable` (a full scan's ids: `.metadata` keys) has and
    the index lacks: a drain cut off by a kill -9 between `.metadata` and its entry, or a
    namespace drained before the index existed. An entry is written only for an id with
    bookkeeping whose manifest parses and names it (never for a junk ``.metadata``);
    `until` (monotonic) stops it. Returns entries written; an outage or a refused write
    only warns (the entries are hints for discovery)."""
    written = 0
    try:
        missing = durable - _indexed_ids(tier, namespace)
        if missing:
            missing &= _bookkept_ids(tier, namespace)
        for checkpoint_id in sorted(missing):
            if until is not None and time.monotonic() >= until:
                logger.warning("%s: durable index repair stopped at its time budget", namespace)
                break
            if _manifest_parses(tier, (namespace, checkpoint_id)):
                write_index_entry(tier, namespace, checkpoint_id)
                written += 1
    except (PersistentTierUnavailable, OSError) as e:
        logger.warning("%s: durable index not repaired: %s", namespace, e)
    if written:
        logger.info("%s: wrote %d missing durable index entries", namespace, written)
    return written


def durable_ids(tier: PersistentTier, namespace: str, *, scan: bool = False) -> set[str]:
    """Ids of the namespace's durable checkpoints, as listed. Without `scan` the index
    entries (a hint: `.metadata` is checked before one is trusted), or the flat prefix
    scan when there are none; with `scan` only the scan (its ``<id>/.metadata`` keys)."""
    if not scan:
        ids = _indexed_ids(tier, namespace)
        if ids:
            return ids
    base = f"{tier.root}/{namespace}"
    ids, bad = metadata_ids(_flat_scan(tier, base), base)
    return _valid_ids(sorted(ids) + bad, namespace)


def _listed_ids(tier: PersistentTier, namespace: str) -> set[str]:
    """`durable_ids` for a re-listing: the index, or the scan's ids that have bookkeeping
    (junk ``.metadata`` keys cost the listing, not a request each)."""
    ids = _indexed_ids(tier, namespace)
    if ids:
        return ids
    scanned = durable_ids(tier, namespace, scan=True)
    return scanned & _bookkept_ids(tier, namespace) if scanned else scanned


# ---- adoption -------------------------------------------------------------------------


def adopt_checkpoint(
    tier: PersistentTier, catalog: Catalog, key: Key, known: set[Key], url: str = ""
) -> int:
    """Adopt one durable checkpoint from its bookkeeping manifest (no file held here);
    1 if the catalog learnt it, 0 if it knew it (now marked durable) or cannot. `url` is
    what the record keeps as its persistent URL (`Roots.url_of(tier)`): where it was
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
        logger.debug("%s/%s is durable but has no manifest; skipped", *key)
        return 0
    rec = manifest_from_json(json.loads(raw))
    if rec.key != key:
        raise ManifestError(f"the manifest describes {rec.namespace}/{rec.checkpoint_id}")
    check_stored_record(rec, time.time())
    if rec.checkpoint_format == FORMAT_FILES:
        # Its commit is the files marker, PUT last: it must be there and list exactly the
        # manifest's files, sizes and checksums (a `.metadata` in its directory is data).
        raw_commit = tier.read_bookkeeping(*key, FILES_COMMIT_OBJECT, max_bytes=MAX_COMMIT)
        if raw_commit is None:
            raise ManifestError(f"{key[0]}/{key[1]}: a files checkpoint without its commit marker")
        check_matches(parse_files_commit(raw_commit), *key, rec.files.values())
    rec.persistent_url = url
    for f in rec.files.values():
        f.held = False
        f.owner_node = ""
        f.replica_nodes = []
    if not catalog.publish(rec, durable=True):
        return 0
    catalog.mark_durable(*key)
    trust = read_trust(tier, key)  # a mark made before the cluster that had it was lost
    if trust is not None:
        catalog.events.trust_found(*key, trust)
    return 1


def _adopt_ids(
    tier: PersistentTier,
    catalog: Catalog,
    namespace: str,
    ids: set[str],
    *,
    verified: bool,
    url: str = "",
    until: float | None = None,
) -> int:
    """Adopt `ids` (`verified`: listed as ``.metadata`` keys, so not probed again); what
    cannot be (no manifest, a refused one) is summarized in one log line per call, not
    one per id (a bucket full of junk keys). `until` (monotonic) stops it."""
    adopted = 0
    skipped: list[str] = []
    first_cause = ""  # why the first refused one was: shown with the summary
    known = set(catalog.committed_keys())
    for checkpoint_id in sorted(ids):
        if until is not None and time.monotonic() >= until:
            logger.warning(
                "%s: adoption stopped at its time budget; the rest is learnt when asked for",
                namespace,
            )
            break
        key = (namespace, checkpoint_id)
        if key in known and catalog.durability.is_durable(*key):
            continue  # nothing to learn
        try:
            # A listing is a hint (an index entry may outlive a .metadata deleted by
            # hand): only the commit marker makes a checkpoint durable.
            if verified or tier.is_durable(*key):
                got = adopt_checkpoint(tier, catalog, key, known, url)
                adopted += got
                if not got and key not in known:
                    skipped.append(checkpoint_id)
        except PersistentTierUnavailable:
            raise
        except Exception as e:
            skipped.append(checkpoint_id)
            cause = f"{checkpoint_id}: {type(e).__name__}: {str(e)[:300]}"
            first_cause = first_cause or cause
            logger.debug("%s/%s", namespace, cause)
    if skipped:
        logger.warning(
            "%s: %d durable-looking checkpoint(s) not adopted from the persistent tier (no "
            "manifest, or one refused), e.g. %s%s",
            namespace,
            len(skipped),
            ", ".join(skipped[:3]),
            f"; first refusal: {first_cause}" if first_cause else "",
        )
    return adopted


def _adopt_namespace(
    tier: PersistentTier, catalog: Catalog, namespace: str, url: str, until: float | None
) -> int:
    """From the index first. Then, in the time left, one flat scan for ``.metadata`` keys
    the index lacks (a namespace drained before the index existed, a drain killed between
    `.metadata` and its entry): only an id with bookkeeping whose manifest parses gets an
    entry and is adopted (`repair_index`), so junk keys cost the listing and nothing else."""
    indexed = _indexed_ids(tier, namespace)
    adopted = 0
    if indexed:
        adopted = _adopt_ids(
            tier, catalog, namespace, indexed, verified=False, url=url, until=until
        )
    if until is not None and time.monotonic() >= until:
        return adopted
    unindexed = durable_ids(tier, namespace, scan=True) - indexed
    if not unindexed:
        return adopted
    candidates = unindexed & _bookkept_ids(tier, namespace)  # junk has no bookkeeping
    if candidates and repair_index(tier, namespace, candidates, until):
        repaired = _indexed_ids(tier, namespace) & candidates
        adopted += _adopt_ids(
            tier, catalog, namespace, repaired, verified=True, url=url, until=until
        )
    return adopted


def _each(fn: Callable[[str], int], items: list[str], workers: int, name: str) -> list[int]:
    """`fn` over `items`, `workers` at a time, on daemon threads (a shutdown never waits
    for a call to a silent endpoint); joined before it returns."""
    queued = iter(items)
    results: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                item = next(queued, None)
            if item is None:
                return
            try:
                result = fn(item)
            except Exception:  # a bug: logged, the other items still run
                logger.exception("%s: %s failed", name, item)
                continue
            with lock:
                results.append(result)

    threads = [
        threading.Thread(target=work, name=name, daemon=True)
        for _ in range(max(1, min(workers, len(items))))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def adopt_all(
    tier: PersistentTier,
    catalog: Catalog,
    url: str = "",
    *,
    budget: float | None = None,
    workers: int = ADOPT_WORKERS,
) -> int:
    """Every durable checkpoint of every namespace in `tier` (a replacement cluster at
    start); `url` as in `adopt_checkpoint`. Namespaces are adopted `workers` at a time,
    each from its index (module doc); after `budget` seconds it stops (what is left is
    learnt when asked for, by `Discovery`).

    Raises:
        PersistentTierUnavailable: an outage (after the other namespaces were tried).
    """
    until = None if budget is None else time.monotonic() + budget

    def bounded() -> AbstractContextManager[None]:
        """Every call of this thread ends by `until` (a silent endpoint included)."""
        return nullcontext() if until is None else tier.within(until - time.monotonic())

    with bounded():
        namespaces = tier.list_namespaces()
    failures: list[Exception] = []

    def one(namespace: str) -> int:
        if until is not None and time.monotonic() >= until:
            return 0
        try:
            with bounded():
                return _adopt_namespace(tier, catalog, namespace, url, until)
        except OSError as e:  # PersistentTierUnavailable, a 403, ...
            failures.append(e)
            return 0

    adopted = sum(_each(one, namespaces, workers, "tierckptd-adopt"))
    if adopted:
        logger.info("adopted %d durable checkpoints from %s", adopted, redact(tier.url))
    if until is not None and time.monotonic() >= until:
        logger.warning(
            "adoption from %s stopped at its %.0fs budget; the rest is learnt when asked for",
            redact(tier.url),
            budget,
        )
    if failures:
        first = failures[0]
        if isinstance(first, PersistentTierUnavailable):
            raise first
        raise PersistentTierUnavailable(f"adopt from {redact(tier.url)}: {first}") from first
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
        wait: how long `refresh` waits for a listing before answering from the catalog.
        listing_deadline: how long one background listing may take in all.
        probe_deadline: how long one `probe` may take in all.
    """

    def __init__(
        self,
        stores: Roots | PersistentTier,
        catalog: Catalog,
        *,
        relist_interval: float = 30.0,
        negative_ttl: float = 10.0,
        max_negative: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        wait: float = LISTING_WAIT,
        listing_deadline: float = LISTING_DEADLINE,
        probe_deadline: float = PROBE_DEADLINE,
        workers: int = RELIST_WORKERS,
    ) -> None:
        self.stores = stores if isinstance(stores, Roots) else Roots(stores)
        self.catalog = catalog
        self.relist_interval = relist_interval
        self.negative_ttl = negative_ttl
        self.max_negative = max_negative
        self.wait = wait
        self.listing_deadline = listing_deadline
        self.probe_deadline = probe_deadline
        self._clock = clock
        self._lock = threading.Lock()  # _listed and _flights; never held over a remote call
        # (namespace, its URL) -> when listed; ("", "") is every namespace of the default.
        self._listed: dict[tuple[str, str], float] = {}
        # (namespace, its URL) -> the listing queued or running for it (single flight).
        self._flights: dict[tuple[str, str], Future[int]] = {}
        self._jobs: queue.SimpleQueue[tuple[Future[int], Callable[[], int]]] = queue.SimpleQueue()
        self._workers = max(1, workers)
        self._started = 0
        self._negative: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        self._neg_lock = threading.Lock()
        self.probes = 0  # remote probes made (tests)
        self.listings = 0  # background listings run (tests)

    def _tier_of(self, namespace: str) -> tuple[PersistentTier | None, str]:
        url = self.catalog.persistent_url(namespace)
        return self.stores.tier(url), url

    def _unavailable(self, tier: PersistentTier, what: str, e: BaseException) -> TierUnavailable:
        cause = tier.backend.describe(e)
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
        Bounded by `probe_deadline` in all (a silent endpoint is TierUnavailable then).

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
            with tier.within(self.probe_deadline):
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

    def refresh(
        self, namespace: str = "", max_age: float | None = None, wait: float | None = None
    ) -> int:
        """Re-list `namespace` ("": every namespace) when this node's view is older than
        `max_age` (default `relist_interval`); returns checkpoints adopted, if the listing
        ended within `wait` seconds (default `self.wait`; 0 otherwise: it goes on in the
        background and the caller answers from what this node knows). One listing per
        namespace at a time: callers that ask meanwhile wait for the same one. An outage
        is logged, not raised. A namespace that changed its URL is listed afresh in the
        new one."""
        if namespace:
            check_namespace(namespace)
        tier, url = self._tier_of(namespace) if namespace else (self.stores.default, "")
        if tier is None:
            return 0
        age = self.relist_interval if max_age is None else max_age
        key = (namespace, url)
        with self._lock:
            now = self._clock()
            last = self._listed.get(key, -1e18)
            if not url:
                last = max(last, self._listed.get(("", ""), -1e18))
            flight = self._flights.get(key)
            if flight is None:
                if now - last < age:
                    return 0
                if len(self._flights) >= MAX_FLIGHTS:
                    logger.debug(
                        "%s: %d listings queued; answered from the catalog", key, MAX_FLIGHTS
                    )
                    return 0
                flight = Future()
                self._flights[key] = flight
                self._jobs.put((flight, lambda: self._relist(tier, namespace, url)))
                if self._started < self._workers:
                    self._started += 1
                    threading.Thread(
                        target=self._work, name="tierckptd-relist", daemon=True
                    ).start()
        try:
            return flight.result(timeout=self.wait if wait is None else wait)
        except TimeoutError:
            return 0  # still listing: the caller answers from the catalog

    def _work(self) -> None:
        """A listing worker (daemon thread): runs queued listings one after another."""
        while True:
            flight, job = self._jobs.get()
            if not flight.set_running_or_notify_cancel():
                continue
            try:
                flight.set_result(job())
            except BaseException as e:  # a bug: logged by _relist, never kills the worker
                flight.set_exception(e)

    def _relist(self, tier: PersistentTier, namespace: str, url: str) -> int:
        """One listing, under `listing_deadline` in all; the view counts as fresh after it,
        failed too (no hammering)."""
        self.listings += 1
        adopted = 0
        try:
            with tier.within(self.listing_deadline):
                for ns in [namespace] if namespace else tier.list_namespaces():
                    ids = _listed_ids(tier, ns)
                    adopted += _adopt_ids(tier, self.catalog, ns, ids, verified=False, url=url)
                    self._forget_deleted(tier, ns, ids, url)
        except OSError as e:  # an outage, a 403: answer from what this node knows
            logger.warning(
                "cannot re-list %s in %s: %s",
                namespace or "the namespaces",
                tier_label(tier.url),
                e,
            )
        except Exception:
            logger.exception("re-listing %s failed", namespace or "the namespaces")
        finally:
            with self._lock:
                self._listed[(namespace, url)] = self._clock()
                self._flights.pop((namespace, url), None)
        if adopted:
            logger.info(
                "adopted %d checkpoint(s) from %s (re-listed)", adopted, tier_label(tier.url)
            )
        return adopted
