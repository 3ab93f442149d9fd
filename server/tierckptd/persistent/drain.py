"""The drain: committed checkpoints into the persistent tier, `.metadata` last.

One `Drainer` per daemon (when ``[persistent] url`` or ``allowed_urls`` is set). Every
committed checkpoint whose sequence is a multiple of ``[persistent] every`` is *due*; it
drains to the tier its manifest names (`persistent.roots`), and one whose URL this node
does not allow is refused like a hostile `.metadata` (below). Each node
uploads the data files it is responsible for (verified reads of its memory tier,
`max_concurrency` at a time, skipped when the marker already describes the same bytes, so
a resumed drain does not upload twice). The committing node then writes the bookkeeping a
restore needs (the checkpoint's manifest: original sizes and block checksums, and the
original `.metadata`) and commits with `PersistentTier.upload_metadata_last`, which
refuses until every data file is there; it simply retries later. Other nodes poll
`is_durable`.

Failures never lose anything: a checkpoint that is due and not durable is pinned in
memory (`Catalog._apply_retention`), and the job is retried with backoff. A restarted
daemon rebuilds the queue from its manifests (`resume`). On SIGTERM `emergency` uploads
every file this node holds (owner or replica) of the newest checkpoint it holds in each
namespace, and commits it if it can, within a deadline: it stops the background worker
first and sets the tier's deadline (`PersistentTier.set_deadline`), so every remote call,
the worker's in-flight one included, gives up by then even with S3 down.

Who uploads which file and who commits (`drain_plan`): a file's owner, or, once the owner
is gone (answered without it, unreachable past `owner_grace`), the first live holder in
its replica order; `.metadata` is committed by the coordinator, or, once it is gone, by
the first live holder of `.metadata`. `peers` (wired in main.py) asks the peers what they
hold; without it each node drains only its own files.

Giving up (audit M7, `drain_backoff`): waits and failures back off exponentially; after
`max_failures` failures in a row, or `max_wait` seconds without becoming durable, the
checkpoint is *drain-failed* and retried only every `failed_retry` seconds. It stays
pinned in memory: invariant 6, an outage delays durability but never loses it.

`.metadata` is decoded with the allow-list (`tierckpt.dcp_metadata`), never unpickled. One
it refuses (a hostile or unparsable pickle), or a checkpoint with no `.metadata`, can never
drain, on any node: it is drain-failed at once, counted in
``tierckpt_refused_metadata{where="drain"}``, not retried, and no longer due, so memory
retention may evict it like any checkpoint that is not due (the newest is still kept).
Pinning it until it is durable would pin it forever: any local client could fill the
memory tier that way.

The decode is bounded (`tierckpt.pickle_scan`: size, depth, expanded object count,
containers built) and runs in a short-lived child process under RLIMIT_AS and RLIMIT_CPU
scaled to the file's size (`persistent.decode`), never in the daemon: a decoder bomb is
refused (the limit it hit named) without touching the daemon's memory or GIL (audit 3,
H1); a child that cannot run (`DecoderUnavailable`) is retried with backoff. A refusal is remembered across restarts (`refusals.RefusedMetadata`, a record in the
memory dir): a restarted daemon does not decode the same `.metadata` again, it marks the
checkpoint drain-failed at once (``tierckpt_refused_metadata{where="drain-remembered"}``).

Operator override: `Drainer.retry_failed()` (meant for SIGHUP) clears every drain-failed
mark and retries those checkpoints at once with fresh counters; a refused `.metadata` is
forgotten, decoded again (still never run) and refused again unless the checkpoint changed.

Persistent retention (``persistent_keep_last``/``persistent_keep_every``) runs on the node
that committed `.metadata`, right after it did: only durable checkpoints are candidates,
the newest committed one is pinned, so an older copy goes only once a newer one is safe.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack

from tierckpt.errors import (
    CheckpointIncomplete,
    CheckpointNotFound,
    TierckptError,
    UnsafeMetadata,
)
from tierckpt.memory_files import VerifiedFile
from tierckpt.names import FORMAT_FILES, METADATA_FILE

from tierckptd.catalog import Catalog
from tierckptd.config_secrets import redact
from tierckptd.jobs import Drain, JobQueue, StepAside
from tierckptd.memory.manifest import ManifestError
from tierckptd.memory.manifest import from_json as manifest_from_json
from tierckptd.model import FileRecord, Key, commit_anchor
from tierckptd.ops import metrics
from tierckptd.ops.faults import fault
from tierckptd.persistent.drain_backoff import DrainBackoff
from tierckptd.persistent.drain_plan import (
    Liveness,
    Outcome,
    PeerLookup,
    Presence,
    is_current,
    plan_drain,
)
from tierckptd.persistent.emergency import emergency_drain
from tierckptd.persistent.format import DataFile, data_files
from tierckptd.persistent.listing import (
    MANIFEST_OBJECT,
    MAX_MANIFEST,
    adopt_all,
    write_index_entry,
)
from tierckptd.persistent.markers import fingerprint
from tierckptd.persistent.refusals import FILE_NAME as REFUSALS_FILE
from tierckptd.persistent.refusals import RefusedMetadata
from tierckptd.persistent.retention import PersistentRetention
from tierckptd.persistent.retry import Op
from tierckptd.persistent.roots import Roots
from tierckptd.persistent.source import METADATA_OBJECT
from tierckptd.persistent.store import FileUpload, PersistentTier, PersistentTierUnavailable
from tierckptd.persistent.trust_marker import TRUST_OBJECT
from tierckptd.persistent.trust_marker import encode as encode_trust

__all__ = [
    "MANIFEST_OBJECT",
    "METADATA_OBJECT",
    "Drainer",
    "Outcome",
    "PeerLookup",
    "Restore",
    "fingerprint",
]

logger = logging.getLogger(__name__)

Restore = Callable[[str, str, str], tuple[FileRecord, str]]
"""The restore chain's `ensure_local(namespace, checkpoint_id, name)`: a verified local
copy of a committed file (record, path), from a peer or the persistent tier."""


class RememberedRefusal(UnsafeMetadata):
    """The checkpoint's `.metadata` was refused before (this run or an earlier one) and
    has not changed: refused again without being decoded."""


def _index(tier: PersistentTier, namespace: str, checkpoint_id: str) -> None:
    """Write the namespace's durable index entry (after `.metadata`: a hint for other
    clusters' discovery, never a commit, so an outage only warns)."""
    try:
        write_index_entry(tier, namespace, checkpoint_id)
    except (PersistentTierUnavailable, OSError) as e:
        logger.warning("%s/%s: no index entry written: %s", namespace, checkpoint_id, e)


def _replaced(
    tier: PersistentTier, namespace: str, checkpoint_id: str, files: Sequence[FileRecord]
) -> bool:
    """Whether the tier holds another generation of the id than `files` (a save that
    overwrote it committed since it drained): its bookkeeping manifest describes other
    bytes. None stored, or one refused: not known to differ (drained before bookkeeping
    existed), so it is taken as this one, as before re-saves existed."""
    try:
        raw = tier.read_bookkeeping(
            namespace, checkpoint_id, MANIFEST_OBJECT, max_bytes=MAX_MANIFEST
        )
        stored = manifest_from_json(json.loads(raw)) if raw is not None else None
    except (ManifestError, ValueError, TypeError, KeyError):
        stored = None
    if stored is None:
        return False
    mine = {f.name: (f.size, fingerprint(f)) for f in files if f.checksums is not None}
    theirs = {f.name: (f.size, fingerprint(f)) for f in stored.files.values() if f.checksums}
    return mine != theirs


def _retire_commit(tier: PersistentTier, namespace: str, checkpoint_id: str, neutral: bool) -> None:
    """Delete the commit of the generation an overwrite replaced (DCP's `.metadata`, or a
    "files" checkpoint's `files-commit.json` marker), before any byte of the new one goes
    up: a reader of the bucket (stock DCP, another cluster's adoption) never pairs it with
    the new data files. The new generation then drains as any checkpoint, its commit last."""
    path = tier.commit_path(namespace, checkpoint_id, files=neutral)
    what = path.rsplit("/", 1)[-1]
    tier.retrying(
        lambda: tier.remove_object(path),
        f"retire the replaced {namespace}/{checkpoint_id}/{what}",
        Op.DELETE,
    )
    fault("drain.retire_metadata")
    logger.info(
        "%s/%s was re-saved: the replaced generation's %s is removed from %s; the new "
        "one drains next",
        namespace,
        checkpoint_id,
        what,
        tier.url,
    )


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
        peers: asks every configured peer what it holds of a checkpoint (main.py wires
            the peer client); None: each node drains only its own files.
        owner_grace: seconds an unreachable owner (or coordinator) is waited for before
            a replica holder drains its files (or commits) instead.
        poll, max_backoff, max_failures, max_wait, failed_retry: see `DrainBackoff`.
        on_evicted: persistent retention deleted a checkpoint (`PersistentRetention`).
    """

    def __init__(
        self,
        catalog: Catalog,
        stores: Roots | PersistentTier,
        restore: Restore | None = None,
        *,
        keep_last: int = 0,
        keep_every: int = 0,
        peers: PeerLookup | None = None,
        owner_grace: float = 30.0,
        poll: float = 0.5,
        max_backoff: float = 10.0,
        max_failures: int = 8,
        max_wait: float = 3600.0,
        failed_retry: float = 300.0,
        on_evicted: Callable[[str, str], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.stores = stores if isinstance(stores, Roots) else Roots(stores)
        self.restore = restore
        self.node_id = catalog.node_id
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.retention = PersistentRetention(catalog, keep_last, keep_every, on_evicted)
        self.peers = peers
        self.liveness = Liveness(owner_grace)
        self.poll = poll
        self.backoff = DrainBackoff(
            catalog,
            poll=poll,
            max_backoff=max_backoff,
            max_failures=max_failures,
            max_wait=max_wait,
            failed_retry=failed_retry,
        )
        self._queue: JobQueue[Drain] = JobQueue(self._job, name="tierckptd-drain")
        self._drain_lock = threading.Lock()
        self.refusals = RefusedMetadata(catalog.tier.root / REFUSALS_FILE, self._has)
        metrics.DRAIN_FAILED.set_function(lambda: len(catalog.durability.drain_failed()))
        metrics.DRAIN_BACKLOG_CHECKPOINTS.set_function(lambda: len(catalog.due_not_durable()))
        metrics.DRAIN_BACKLOG_BYTES.set_function(self.backlog_bytes)

    def _has(self, key: Key) -> bool:
        try:
            self.catalog.get(*key)
        except CheckpointNotFound:
            return False
        return True

    def backlog_bytes(self) -> int:
        """Bytes of the files this node owns and holds of the checkpoints due and not
        durable: its share of the drain still to do (the nodes' shares add up)."""
        total = 0
        for key in self.catalog.due_not_durable():
            try:
                view = self.catalog.get(*key)
            except CheckpointNotFound:
                continue  # evicted or deleted meanwhile
            total += sum(f.size for f in view.files if f.held and f.owner_node == self.node_id)
        return total

    # ---- queue ------------------------------------------------------------------------
    def enqueue(self, namespace: str, checkpoint_id: str, delay: float = 0.0) -> None:
        """Schedule a drain attempt (non-blocking: safe under the catalog lock); queueing
        it again keeps the earlier due time."""
        self._queue.put(Drain(namespace, checkpoint_id), delay)

    def check_now(self, namespace: str, checkpoint_id: str) -> None:
        """A peer says the checkpoint is durable (`CatalogEvents.durable_elsewhere`): if it is
        due here and not known durable, its next drain attempt, which first asks the
        persistent tier whether it is committed there, runs now, not after its back-off.
        The peer's word is never taken: only the persistent tier's marks."""
        if (namespace, checkpoint_id) in set(self.catalog.due_not_durable()):
            self.enqueue(namespace, checkpoint_id)

    def resume(self) -> int:
        """Queue every committed checkpoint that is due and not known durable, except
        the ones whose `.metadata` was refused before the restart (marked at once)."""
        keys = [k for k in self.catalog.due_not_durable() if not self._refused_before(k)]
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
            return self.backoff.unsuccessful(key, e)
        except Exception as e:
            logger.warning(
                "persistent tier drain of %s/%s failed: %s: %.300s",
                *key,
                type(e).__name__,
                e,
                exc_info=not isinstance(e, TierckptError | OSError),  # a bug: the traceback
            )
            return self.backoff.unsuccessful(key, e)
        if done:
            self.backoff.succeeded(key)
            return None
        return self.backoff.unsuccessful(key, None)

    def retry_failed(self) -> int:
        """Operator override (SIGHUP): retry every drain-failed checkpoint now, with
        fresh counters, decoding a refused `.metadata` again. Returns how many were
        queued."""
        keys = sorted(self.catalog.durability.drain_failed())
        self.refusals.forget(keys)
        for key in keys:
            self.backoff.reset(key)
            self.enqueue(*key)
        if keys:
            logger.info("retrying the drain of %d drain-failed checkpoint(s)", len(keys))
        return len(keys)

    # ---- one attempt ------------------------------------------------------------------
    def drain(self, namespace: str, checkpoint_id: str) -> bool:
        """One attempt: upload the files this node is responsible for, commit if it is
        the committer (`drain_plan`).

        Returns True when the checkpoint is durable (or gone), False to try again later.

        Raises:
            PersistentTierUnavailable: an outage.
            UnsafeMetadata: its `.metadata` is refused (now or before): it is marked
                drain-failed and no longer due.
        """
        with self._drain_lock:
            return self._drain_or_refuse(namespace, checkpoint_id) is Outcome.DURABLE

    def _drain_or_refuse(
        self, namespace: str, checkpoint_id: str, *, everything: bool = False
    ) -> Outcome:
        key = (namespace, checkpoint_id)
        if self.catalog.durability.drain_failed().get(key):
            raise UnsafeMetadata(
                f"persistent tier drain of {namespace}/{checkpoint_id}: its .metadata was "
                "refused; Drainer.retry_failed() (SIGHUP) decodes it again"
            )
        try:
            return self._drain(namespace, checkpoint_id, everything)
        except RememberedRefusal as e:
            self._mark_refused_before(key, str(e))
            raise
        except UnsafeMetadata as e:
            self.backoff.refuse(key, e)
            raise

    def _refused_before(self, key: Key) -> bool:
        """Whether the checkpoint's `.metadata` is one refused before (then marked
        drain-failed and refused, without decoding it)."""
        try:
            if self.catalog.get(*key).checkpoint_format == FORMAT_FILES:
                return False  # never decoded, so never refused
            f, _ = self.catalog.file_view(*key, METADATA_FILE)
        except CheckpointNotFound:
            return False
        why = self.refusals.why(key, fingerprint(f)) if f.checksums is not None else None
        if why is not None:
            self._mark_refused_before(key, why)
        return why is not None

    def _mark_refused_before(self, key: Key, why: str) -> None:
        metrics.REFUSED_METADATA.labels(where="drain-remembered").inc()
        self.catalog.set_drain_failed(*key, True, refused=True)
        logger.warning(
            "persistent tier drain of %s/%s: its .metadata was refused before and has not "
            "changed, so it is not decoded again (%s); it stays drain-failed. Delete it "
            "(tierckpt rm %s %s), or SIGHUP to decode it again",
            *key,
            why,
            *key,
        )

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

    def _presence(self, namespace: str, checkpoint_id: str, ask: list[FileRecord]) -> Presence:
        """This node's view of the others: the owners and replica nodes of the files in
        `ask` are asked what they hold (no one when `ask` is empty)."""
        if not ask or self.peers is None:
            return Presence(self.node_id)
        nodes = {n for f in ask for n in (f.owner_node, *f.replica_nodes)} - {"", self.node_id}
        peers = self.peers(namespace, checkpoint_id, sorted(nodes))
        return Presence(self.node_id, peers, self.liveness.observe(peers))

    def _drain(self, namespace: str, checkpoint_id: str, everything: bool) -> Outcome:
        if self.catalog.durability.is_durable(namespace, checkpoint_id):
            return Outcome.DURABLE
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return Outcome.DURABLE  # deleted meanwhile
        tier = self._tier(namespace, checkpoint_id, view.persistent_url)
        neutral = view.checkpoint_format == FORMAT_FILES
        marked = (
            tier.is_durable(namespace, checkpoint_id, FORMAT_FILES)
            if neutral
            else tier.is_durable(namespace, checkpoint_id)
        )
        if marked:
            if not _replaced(tier, namespace, checkpoint_id, view.files):
                # Drained before a restart cut it short: its index entry may be missing.
                _index(tier, namespace, checkpoint_id)
                self.catalog.mark_durable(namespace, checkpoint_id)
                return Outcome.DURABLE
            _retire_commit(tier, namespace, checkpoint_id, neutral)
        files = {f.name: f for f in view.files}
        # The commit's anchor: DCP's `.metadata`; a "files" checkpoint's is the file its
        # coordinator owns (`model.commit_anchor`), uploaded like every other.
        meta = files.get(commit_anchor(files, view.checkpoint_format))
        if meta is None:
            raise UnsafeMetadata(
                f"{namespace}/{checkpoint_id} has no .metadata, so it is not a DCP "
                "checkpoint and cannot be drained"
            )
        me = self.node_id
        data = [f for f in view.files if neutral or f.name != METADATA_FILE]
        meta_copy = meta.held and meta.owner_node != me  # may commit if the coordinator is gone
        listed = any(f.held for f in data) or meta_copy
        uploaded = tier.uploaded(namespace, checkpoint_id) if listed else {}
        pending = [f.name for f in data if not is_current(uploaded.get(f.name), f)]
        # The peers matter when this node holds another owner's file that is not up yet,
        # or a copy of another coordinator's .metadata (asked whenever the peers are, so
        # a coordinator never counts as gone for not being asked).
        ask = (
            []
            if everything
            else [files[n] for n in pending if files[n].held and files[n].owner_node != me]
        )
        if meta_copy and not everything and (ask or not pending):
            ask.append(meta)
        plan = plan_drain(
            view.files,
            pending,
            self._presence(namespace, checkpoint_id, ask),
            everything=everything,
            anchor=meta.name,
            anchor_is_data=neutral,
        )
        if plan.unheld:
            logger.debug(
                "drain of %s/%s: no live node holds %s", namespace, checkpoint_id, plan.unheld
            )
        if not plan.commit and self.retention.superseded(tier, namespace, checkpoint_id):
            return Outcome.DURABLE
        metadata: bytes | None = None
        if plan.upload:
            theirs = [n for n in plan.upload if files[n].owner_node != me]
            if theirs:
                logger.info(
                    "drain of %s/%s: uploading %d file(s) other nodes own (%s)",
                    namespace,
                    checkpoint_id,
                    len(theirs),
                    "SIGTERM" if everything else "their owner is gone",
                )
            # A "files" checkpoint is never decoded: its files go up verbatim.
            metadata, items = (b"", {}) if neutral else self._metadata(namespace, checkpoint_id)
            self._upload(
                tier,
                namespace,
                checkpoint_id,
                [files[n] for n in plan.upload],
                items,
                any_name=neutral,
            )
        if not plan.commit:
            return Outcome.UPLOADED if everything else Outcome.WAITING
        if neutral:
            metadata = b""
        elif metadata is None:
            metadata, _ = self._metadata(namespace, checkpoint_id)
        if not self.catalog.knows(namespace, checkpoint_id):
            # An rm's mark arrived while the files went up (audit 3 M4): no `.metadata`
            # makes it loadable; marking it durable tells the rm's side, which deletes
            # what went up (`Catalog.on_gone_durable`).
            self.catalog.mark_durable(namespace, checkpoint_id)
            return Outcome.DURABLE
        return self._commit(
            tier,
            namespace,
            checkpoint_id,
            metadata,
            plan.by_rule,
            view.sequence,
            view.files if neutral else None,
        )

    def _commit(
        self,
        tier: PersistentTier,
        namespace: str,
        checkpoint_id: str,
        metadata: bytes,
        by_rule: bool,
        sequence: int,
        neutral_files: Sequence[FileRecord] | None = None,
    ) -> Outcome:
        """Bookkeeping, then `.metadata` last (for a "files" checkpoint, `neutral_files`
        given: its `files_commit` marker last); persistent retention after a commit by the
        committer the rule names (not after SIGTERM's best-effort one). Not when a save
        replaced the checkpoint since this attempt began (`sequence`, the generation it
        drained, is no longer the one committed): that one drains next."""
        if not self._still(namespace, checkpoint_id, sequence):
            return Outcome.WAITING
        tier.put_bookkeeping(
            namespace,
            checkpoint_id,
            MANIFEST_OBJECT,
            json.dumps(self.catalog.manifest_document(namespace, checkpoint_id)).encode(),
        )
        if neutral_files is None:
            tier.put_bookkeeping(namespace, checkpoint_id, METADATA_OBJECT, metadata)
        trust = self.catalog.events.trust_marks(namespace).get(checkpoint_id)
        if trust is not None:  # marked before it drained: kept beside it (trust_marker)
            tier.put_bookkeeping(namespace, checkpoint_id, TRUST_OBJECT, encode_trust(trust))
        if not self._still(namespace, checkpoint_id, sequence):
            return Outcome.WAITING
        try:
            fault("drain.metadata")
            if neutral_files is not None:
                tier.commit_files_last(namespace, checkpoint_id, neutral_files)
            else:
                tier.upload_metadata_last(namespace, checkpoint_id, metadata)
        except CheckpointIncomplete as e:
            logger.debug("drain of %s/%s waits for other nodes: %s", namespace, checkpoint_id, e)
            return Outcome.WAITING if by_rule else Outcome.UPLOADED
        fault("drain.after_metadata")
        # The index entry before the catalog says DURABLE: a kill -9 in between drains
        # again after the restart, which finds `.metadata` up and writes the entry then,
        # instead of leaving a durable checkpoint that other clusters' listings never show.
        _index(tier, namespace, checkpoint_id)
        self.catalog.mark_durable(namespace, checkpoint_id)
        try:
            committed = self.catalog.get(namespace, checkpoint_id).committed_unix
            metrics.DRAIN_DURATION.observe(max(0.0, time.time() - committed))
        except CheckpointNotFound:
            pass  # deleted meanwhile: nothing to time
        if not by_rule:
            logger.info(
                "%s/%s committed on SIGTERM by a holder of .metadata", namespace, checkpoint_id
            )
        if by_rule:
            self.retention.apply(tier, namespace)
        return Outcome.DURABLE

    def _still(self, namespace: str, checkpoint_id: str, sequence: int) -> bool:
        """Whether the generation of the checkpoint committed here is still `sequence`
        (False: re-saved since the drain attempt began). A deleted one is left to the
        rm's own handling of a drain that raced it (`mark_durable`, `gone_durable`)."""
        try:
            return self.catalog.get(namespace, checkpoint_id).sequence == sequence
        except CheckpointNotFound:
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
        key, bytes_id = (namespace, checkpoint_id), fingerprint(f)
        why = self.refusals.why(key, bytes_id)
        if why is not None:
            raise RememberedRefusal(why)  # refused before: never decoded twice
        with VerifiedFile(path, f.size, f.checksums, what=what) as vf:
            raw = bytes(vf.read(0, f.size))
        try:
            # In a child process under memory and CPU limits (persistent.decode).
            return raw, data_files(raw, what=what)
        except UnsafeMetadata as e:
            self.refusals.remember(key, bytes_id, str(e))
            raise

    def _upload(
        self,
        tier: PersistentTier,
        namespace: str,
        checkpoint_id: str,
        todo: list[FileRecord],
        described: dict[str, DataFile],
        *,
        any_name: bool = False,
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
                        any_name=any_name,
                    )
                )
            done = tier.upload_files(namespace, checkpoint_id, uploads)
        metrics.DRAINED_BYTES.inc(sum(u.source_size for u in done))

    # ---- shutdown -----------------------------------------------------------------------
    def emergency(self, deadline: float) -> bool:
        """SIGTERM's drain within `deadline` seconds (`emergency.emergency_drain`)."""
        return emergency_drain(self, deadline)

    def attempt_locked(self, key: Key, timeout: float, *, everything: bool) -> Outcome | None:
        """One attempt under the drain lock, waiting at most `timeout` seconds for it
        (None: the lock was not free in time)."""
        if timeout <= 0 or not self._drain_lock.acquire(timeout=timeout):
            return None
        try:
            return self._drain_or_refuse(*key, everything=everything)
        finally:
            self._drain_lock.release()

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
