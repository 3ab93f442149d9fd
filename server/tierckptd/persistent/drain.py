"""The drain: committed checkpoints into the persistent tier, `.metadata` last.

One `Drainer` per daemon (when ``[persistent] url`` or ``allowed_urls`` is set). Every
committed checkpoint whose sequence is a multiple of ``[persistent] every`` is *due*; it
drains to the tier its manifest names (`persistent.stores`), and one whose URL this node
does not allow is refused like a hostile `.metadata` (below). Each node
uploads the data files it owns (verified reads of its memory tier, `max_concurrency` at a
time, skipped when the marker already describes the same bytes, so a resumed drain does
not upload twice). The node that owns `.metadata` then writes the bookkeeping a restore
needs (the checkpoint's manifest: original sizes and block checksums, and the original
`.metadata`) and commits with `PersistentTier.upload_metadata_last`, which refuses until
every owner's files are there; it simply retries later. Other nodes poll `is_durable`.

Failures never lose anything: a checkpoint that is due and not durable is pinned in
memory (`Catalog._apply_retention`), and the job is retried with backoff. A restarted
daemon rebuilds the queue from its manifests (`resume`). On SIGTERM `emergency` drains
the newest committed checkpoint within a deadline: it stops the background worker first
and sets the tier's deadline (`PersistentTier.set_deadline`), so every remote call, the
worker's in-flight one included, gives up by then even with S3 down.

Giving up (audit M7). An attempt ends durable, waiting (another node commits, or other
owners still upload) or failed. Waits and failures back off exponentially from `poll` to
`max_backoff`. After `max_failures` failures in a row, or `max_wait` seconds without
becoming durable, the checkpoint is *drain-failed*: "drain-failed" in its tiers (`tierckpt
ls`), counted by the ``tierckpt_drain_failed_checkpoints`` gauge, and retried only every
`failed_retry` seconds, so an outage still recovers by itself while a checkpoint that never
drains costs one probe every few minutes. It stays pinned in memory: invariant 6, an
outage delays durability but never loses it.

`.metadata` is decoded with the allow-list (`tierckpt.dcp_metadata`), never unpickled. One
it refuses (a hostile or unparsable pickle), or a checkpoint with no `.metadata`, can never
drain, on any node: it is drain-failed at once, counted in
``tierckpt_refused_metadata{where="drain"}``, not retried, and no longer due, so memory
retention may evict it like any checkpoint that is not due (the newest is still kept).
Pinning it until it is durable would pin it forever: any local client could fill the
memory tier that way.

Operator override: `Drainer.retry_failed()` (meant for SIGHUP) clears every drain-failed
mark and retries those checkpoints at once with fresh counters; a refused `.metadata` is
decoded again (still never run) and refused again unless the checkpoint changed.

Persistent retention (``persistent_keep_last``/``persistent_keep_every``) runs on the node
that committed `.metadata`, right after it did: only durable checkpoints are candidates,
the newest committed one is pinned, so an older copy goes only once a newer one is safe.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

from tierckpt.errors import (
    CheckpointIncomplete,
    CheckpointNotFound,
    TierckptError,
    UnsafeMetadata,
)
from tierckpt.memory_files import VerifiedFile
from tierckpt.names import METADATA_FILE

from tierckptd.catalog import Catalog
from tierckptd.config_secrets import redact
from tierckptd.jobs import Drain, JobQueue, StepAside
from tierckptd.model import FileRecord, Key
from tierckptd.ops import metrics
from tierckptd.ops.faults import fault
from tierckptd.persistent.discovery import (
    MANIFEST_OBJECT,
    adopt_all,
    write_index_entry,
)
from tierckptd.persistent.format import DataFile, data_files
from tierckptd.persistent.markers import fingerprint
from tierckptd.persistent.retention import PersistentRetention
from tierckptd.persistent.source import METADATA_OBJECT
from tierckptd.persistent.store import FileUpload, PersistentTier, PersistentTierUnavailable
from tierckptd.persistent.stores import Stores

__all__ = ["MANIFEST_OBJECT", "METADATA_OBJECT", "Drainer", "Restore", "fingerprint"]

logger = logging.getLogger(__name__)

Restore = Callable[[str, str, str], tuple[FileRecord, str]]
"""The restore chain's `ensure_local(namespace, checkpoint_id, name)`: a verified local
copy of a committed file (record, path), from a peer or the persistent tier."""


class _StepAsideForSaves:
    """A file source whose reads wait while a save is writing on this node, so a drain
    in flight does not compete with training; each file waits `jobs.SAVE_YIELD_MAX` at
    most in total, so back-to-back saves cannot stall durability forever."""

    def __init__(self, source: VerifiedFile, catalog: Catalog) -> None:
        self.size = source.size
        self._source = source
        self._aside = StepAside(catalog.saving)

    def read(self, start: int, length: int) -> bytes | bytearray:
        self._aside.wait()
        return self._source.read(start, length)


class Drainer:
    """Background drain of due checkpoints; one worker thread, jobs retried with backoff.

    Args:
        poll: the first delay after a waiting or failed attempt; doubles each time.
        max_backoff: the longest delay between attempts of a checkpoint not drain-failed.
        max_failures: failed attempts in a row after which it is drain-failed.
        max_wait: seconds without becoming durable after which it is drain-failed.
        failed_retry: the delay between attempts of a drain-failed checkpoint.
    """

    def __init__(
        self,
        catalog: Catalog,
        stores: Stores | PersistentTier,
        restore: Restore | None = None,
        *,
        keep_last: int = 0,
        keep_every: int = 0,
        poll: float = 0.5,
        max_backoff: float = 10.0,
        max_failures: int = 8,
        max_wait: float = 3600.0,
        failed_retry: float = 300.0,
    ) -> None:
        self.catalog = catalog
        self.stores = stores if isinstance(stores, Stores) else Stores(stores)
        self.restore = restore
        self.node_id = catalog.node_id
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.retention = PersistentRetention(catalog, keep_last, keep_every)
        self.poll = poll
        self.max_backoff = max_backoff
        self.max_failures = max_failures
        self.max_wait = max_wait
        self.failed_retry = failed_retry
        self._cv = threading.Condition()  # guards the counters below
        self._queue: JobQueue[Drain] = JobQueue(self._job, name="tierckptd-drain")
        # Per checkpoint, since its last success: unsuccessful attempts in a row (the
        # backoff), failed ones in a row, when the first one was; and the ones given up on.
        self._tries: dict[Key, int] = {}
        self._failures: dict[Key, int] = {}
        self._since: dict[Key, float] = {}
        self._failing: set[Key] = set()
        self._drain_lock = threading.Lock()
        metrics.DRAIN_FAILED.set_function(lambda: len(catalog.drain_failed()))

    # ---- queue ------------------------------------------------------------------------
    def enqueue(self, namespace: str, checkpoint_id: str, delay: float = 0.0) -> None:
        """Schedule a drain attempt (non-blocking: safe under the catalog lock); queueing
        it again keeps the earlier due time."""
        self._queue.put(Drain(namespace, checkpoint_id), delay)

    def resume(self) -> int:
        """Queue every committed checkpoint that is due and not known durable."""
        keys = self.catalog.due_not_durable()
        for key in keys:
            self.enqueue(*key)
        if keys:
            logger.info("drain: %d committed checkpoints due", len(keys))
        return len(keys)

    def pending(self) -> list[Key]:
        return sorted((j.namespace, j.checkpoint_id) for j in self._queue.pending())

    def start(self) -> None:
        self._queue.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.stop(timeout)

    def _job(self, job: Drain) -> float | None:
        """The queue's handler: one attempt, then the delay before the next (None: done)."""
        return self._attempt((job.namespace, job.checkpoint_id))

    def _attempt(self, key: Key) -> float | None:
        """One attempt of the worker; the delay before the next one (None: finished)."""
        try:
            done = self.drain(*key)
        except UnsafeMetadata:
            return None  # refused (logged, counted and marked by drain): never retried
        except PersistentTierUnavailable as e:
            logger.warning("persistent tier drain of %s/%s delayed: %s", *key, e)
            return self._unsuccessful(key, e)
        except Exception as e:
            logger.warning(
                "persistent tier drain of %s/%s failed: %s: %.300s",
                *key,
                type(e).__name__,
                e,
                exc_info=not isinstance(e, TierckptError | OSError),  # a bug: the traceback
            )
            return self._unsuccessful(key, e)
        if done:
            self._succeeded(key)
            return None
        return self._unsuccessful(key, None)

    # ---- giving up ----------------------------------------------------------------------
    def _unsuccessful(self, key: Key, error: Exception | None) -> float:
        """Count a waiting (`error` None) or failed attempt; the delay before the next."""
        now = time.monotonic()
        with self._cv:
            tries = self._tries[key] = self._tries.get(key, 0) + 1
            since = self._since.setdefault(key, now)
            if error is None:
                self._failures.pop(key, None)  # the tier answered
                failures = 0
            else:
                failures = self._failures[key] = self._failures.get(key, 0) + 1
            failing = key in self._failing
        if not failing:
            if failures >= self.max_failures:
                why = (
                    f"failed {failures} times in a row (last: {type(error).__name__}: "
                    f"{str(error)[:300]})"
                )
                self._give_up(key, why)
                failing = True
            elif now - since >= self.max_wait:
                why = (
                    f"is not durable after {now - since:.0f}s of waiting (for other nodes' "
                    "uploads, or for the node that owns .metadata to commit it)"
                )
                self._give_up(key, why)
                failing = True
        if failing:
            return self.failed_retry
        return float(min(self.max_backoff, self.poll * 2.0 ** min(tries - 1, 30)))

    def _give_up(self, key: Key, why: str) -> None:
        with self._cv:
            self._failing.add(key)
        self.catalog.set_drain_failed(*key, True)
        logger.error(
            "persistent tier drain of %s/%s %s; marked drain-failed (see tierckpt ls) and "
            "retried every %.0fs; it stays in memory until it is durable. Fix the cause "
            "(the persistent tier's reachability, credentials, or the other nodes); "
            "Drainer.retry_failed() (SIGHUP) retries at once",
            *key,
            why,
            self.failed_retry,
        )

    def _succeeded(self, key: Key) -> None:
        with self._cv:
            for counter in (self._tries, self._failures, self._since):
                counter.pop(key, None)
            recovered = key in self._failing
            self._failing.discard(key)
        if recovered:
            self.catalog.set_drain_failed(*key, False)
            logger.info("persistent tier drain of %s/%s recovered: it is durable", *key)

    def _refuse(self, key: Key, error: UnsafeMetadata) -> None:
        """A `.metadata` that can never drain: drain-failed at once, no longer due."""
        metrics.REFUSED_METADATA.labels(where="drain").inc()
        with self._cv:
            for counter in (self._tries, self._failures, self._since):
                counter.pop(key, None)
            self._failing.discard(key)
        self.catalog.set_drain_failed(*key, True, refused=True)
        logger.error(
            "persistent tier drain of %s/%s refused: %s. The checkpoint is not drained and "
            "is marked drain-failed (see tierckpt ls); it is not retried and memory "
            "retention may evict it. Delete it (tierckpt rm %s %s) or save it again",
            *key,
            error,
            *key,
        )

    def retry_failed(self) -> int:
        """Operator override (SIGHUP): retry every drain-failed checkpoint now, with
        fresh counters. Returns how many were queued."""
        keys = sorted(self.catalog.drain_failed())
        for key in keys:
            with self._cv:
                for counter in (self._tries, self._failures, self._since):
                    counter.pop(key, None)
                self._failing.discard(key)
            self.catalog.set_drain_failed(*key, False)
            self.enqueue(*key)
        if keys:
            logger.info("retrying the drain of %d drain-failed checkpoint(s)", len(keys))
        return len(keys)

    # ---- one attempt ------------------------------------------------------------------
    def drain(self, namespace: str, checkpoint_id: str) -> bool:
        """One attempt: upload what this node owns, commit if it holds `.metadata`.

        Returns True when the checkpoint is durable (or gone), False to try again later.

        Raises:
            PersistentTierUnavailable: an outage.
            UnsafeMetadata: its `.metadata` is refused (now or before): it is marked
                drain-failed and no longer due.
        """
        with self._drain_lock:
            return self._drain_or_refuse(namespace, checkpoint_id)

    def _drain_or_refuse(self, namespace: str, checkpoint_id: str) -> bool:
        key = (namespace, checkpoint_id)
        if self.catalog.drain_failed().get(key):
            raise UnsafeMetadata(
                f"persistent tier drain of {namespace}/{checkpoint_id}: its .metadata was "
                "refused; Drainer.retry_failed() (SIGHUP) decodes it again"
            )
        try:
            return self._drain(namespace, checkpoint_id)
        except UnsafeMetadata as e:
            self._refuse(key, e)
            raise

    def _tier(self, namespace: str, checkpoint_id: str, url: str) -> PersistentTier:
        tier = self.stores.tier(url)
        if tier is None:
            raise UnsafeMetadata(
                f"{namespace}/{checkpoint_id} was committed to drain to "
                f"{redact(url) or 'the default [persistent] url'}, which node {self.node_id} "
                "does not have or allow; give every node the same [persistent] url and "
                "allowed_urls"
            )
        return tier

    def _drain(self, namespace: str, checkpoint_id: str) -> bool:
        if self.catalog.is_durable(namespace, checkpoint_id):
            return True
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return True  # deleted meanwhile
        tier = self._tier(namespace, checkpoint_id, view.persistent_url)
        if tier.is_durable(namespace, checkpoint_id):
            self.catalog.mark_durable(namespace, checkpoint_id)
            return True
        files = {f.name: f for f in view.files}
        meta = files.get(METADATA_FILE)
        if meta is None:
            raise UnsafeMetadata(
                f"{namespace}/{checkpoint_id} has no .metadata, so it is not a DCP "
                "checkpoint and cannot be drained"
            )
        mine = [
            f
            for f in view.files
            if f.name != METADATA_FILE and f.owner_node == self.node_id and f.held
        ]
        committer = meta.owner_node == self.node_id or (not meta.owner_node and meta.held)
        if not committer and self.retention.superseded(tier, namespace, checkpoint_id):
            return True
        metadata: bytes | None = None
        if mine:
            uploaded = tier.uploaded(namespace, checkpoint_id)
            todo = [
                f
                for f in mine
                if (m := uploaded.get(f.name)) is None
                or m.fingerprint != fingerprint(f)
                or m.source_size != f.size
            ]
            if todo:
                metadata, items = self._metadata(namespace, checkpoint_id)
                self._upload(tier, namespace, checkpoint_id, todo, items)
        if not committer:
            return False  # the owner of .metadata commits; the next attempt probes
        if metadata is None:
            metadata, _ = self._metadata(namespace, checkpoint_id)
        tier.put_bookkeeping(
            namespace,
            checkpoint_id,
            MANIFEST_OBJECT,
            json.dumps(self.catalog.manifest_document(namespace, checkpoint_id)).encode(),
        )
        tier.put_bookkeeping(namespace, checkpoint_id, METADATA_OBJECT, metadata)
        try:
            fault("drain.metadata")
            tier.upload_metadata_last(namespace, checkpoint_id, metadata)
        except CheckpointIncomplete as e:
            logger.debug("drain of %s/%s waits for other owners: %s", namespace, checkpoint_id, e)
            return False
        fault("drain.after_metadata")
        self.catalog.mark_durable(namespace, checkpoint_id)
        try:  # after .metadata: a hint for other clusters' discovery, never a commit
            write_index_entry(tier, namespace, checkpoint_id)
        except (PersistentTierUnavailable, OSError) as e:
            logger.warning("%s/%s: no index entry written: %s", namespace, checkpoint_id, e)
        self.retention.apply(tier, namespace)
        return True

    def _metadata(self, namespace: str, checkpoint_id: str) -> tuple[bytes, dict[str, DataFile]]:
        """The memory tier's `.metadata`, verified (fetched from a peer if not held), and
        the data files it describes. Every node that uploads decodes it (allow-list, never
        pickle), so a hostile one is refused everywhere, whatever the compression."""
        f, path = self.catalog.file_view(namespace, checkpoint_id, METADATA_FILE)
        if not path and self.restore is not None:
            f, path = self.restore(namespace, checkpoint_id, METADATA_FILE)
        if not path:
            raise CheckpointNotFound(
                f"{namespace}/{checkpoint_id}: no copy of .metadata on node {self.node_id}"
            )
        assert f.checksums is not None
        what = f"{namespace}/{checkpoint_id}/{METADATA_FILE}"
        with VerifiedFile(path, f.size, f.checksums, what=what) as vf:
            raw = bytes(vf.read(0, f.size))
        return raw, data_files(raw, what=what)

    def _upload(
        self,
        tier: PersistentTier,
        namespace: str,
        checkpoint_id: str,
        todo: list[FileRecord],
        described: dict[str, DataFile],
    ) -> None:
        items = described if tier.compression == "zstd" else {}
        with ExitStack() as stack:
            uploads = []
            for f in todo:
                fault("drain.upload")
                _, path = self.catalog.file_view(namespace, checkpoint_id, f.name)
                if not path:
                    continue  # evicted or dropped meanwhile
                assert f.checksums is not None
                what = f"{namespace}/{checkpoint_id}/{f.name} on node {self.node_id}"
                vf = stack.enter_context(VerifiedFile(path, f.size, f.checksums, what=what))
                found = items.get(f.name)
                uploads.append(
                    FileUpload(
                        name=f.name,
                        source=_StepAsideForSaves(vf, self.catalog),
                        size=f.size,
                        items=found.items if found is not None else None,
                        fingerprint=fingerprint(f),
                    )
                )
            tier.upload_files(namespace, checkpoint_id, uploads)

    # ---- shutdown -----------------------------------------------------------------------
    def emergency(self, deadline: float) -> bool:
        """SIGTERM: drain the newest committed checkpoint not yet durable, for at most
        `deadline` seconds. True when it is durable (or there was nothing to do).

        The background worker is stopped first and the tier's deadline is set for good
        (the daemon is exiting): every remote call, in flight or not, ends by then.
        """
        end = time.monotonic() + deadline
        self.stop(timeout=0)
        for tier in self.stores.known():
            tier.set_deadline(deadline)
        refused = self.catalog.drain_failed()
        newest: dict[str, Key] = {}
        for view in self.catalog.list_checkpoints():
            newest[view.namespace] = (view.namespace, view.checkpoint_id)
        keys = [
            k for k in newest.values() if not self.catalog.is_durable(*k) and not refused.get(k)
        ]
        if not keys:
            return True
        ok = True
        for key in keys:
            logger.info("shutdown: draining %s/%s (deadline %.0fs)", *key, deadline)
            while True:
                done = False
                remaining = end - time.monotonic()
                if remaining > 0 and self._drain_lock.acquire(timeout=remaining):
                    try:
                        done = self._drain_or_refuse(*key)
                    except UnsafeMetadata:
                        ok = False
                        break
                    except Exception as e:
                        logger.warning("shutdown drain of %s/%s: %.300s", *key, e)
                    finally:
                        self._drain_lock.release()
                if done:
                    logger.info("shutdown: %s/%s is durable", *key)
                    break
                if time.monotonic() + self.poll > end:
                    logger.error("shutdown: %s/%s not durable within the deadline", *key)
                    ok = False
                    break
                time.sleep(self.poll)
        return ok

    # ---- adoption ------------------------------------------------------------------------
    def adopt_durable(self) -> int:
        """Learn the durable checkpoints this node does not know (a replacement cluster
        whose memory tiers are all gone): their manifests come from the bookkeeping
        area, with no file held anywhere; files are fetched from S3 on demand
        (`discovery.adopt_all`: invalid names skipped, manifests range-checked, one bad
        key never stops the others). An outage raises PersistentTierUnavailable.
        """
        return sum(
            adopt_all(tier, self.catalog, self.stores.url_of(tier)) for tier in self.stores.known()
        )
