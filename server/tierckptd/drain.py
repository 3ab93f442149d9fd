"""The drain: committed checkpoints into the persistent tier, `.metadata` last.

One `Drainer` per daemon (only when ``[persistent] url`` is set). Every committed
checkpoint whose sequence is a multiple of ``[persistent] every`` is *due*. Each node
uploads the data files it owns (verified reads of its memory tier, `max_concurrency` at a
time, skipped when the marker already describes the same bytes, so a resumed drain does
not upload twice). The node that owns `.metadata` then writes the bookkeeping a restore
needs (the checkpoint's manifest: original sizes and block checksums, and the original
`.metadata`) and commits with `PersistentTier.upload_metadata_last`, which refuses until
every owner's files are there; it simply retries later. Other nodes poll `is_durable`.

Failures never lose anything: a checkpoint that is due and not durable is pinned in
memory (`Catalog._apply_retention`), and the job is retried with backoff. A restarted
daemon rebuilds the queue from its manifests (`resume`). On SIGTERM `emergency` drains
the newest committed checkpoint within a deadline.

Persistent retention (``persistent_keep_last``/``persistent_keep_every``) runs on the node
that committed `.metadata`, right after it did: only durable checkpoints are candidates,
the newest committed one is pinned, so an older copy goes only once a newer one is safe.
"""

from __future__ import annotations

import heapq
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import xxhash
import zstandard
from tierckpt.errors import (
    CheckpointIncomplete,
    CheckpointNotFound,
    ChecksumMismatch,
    InvalidName,
)
from tierckpt.memory_files import VerifiedFile
from tierckpt.names import METADATA_FILE

from tierckptd.catalog import Catalog
from tierckptd.manifest import ManifestError
from tierckptd.manifest import from_json as manifest_from_json
from tierckptd.model import FileRecord
from tierckptd.peers import SAVE_YIELD_MAX, Cluster, install_copy
from tierckptd.persistent import FileUpload, PersistentTier, PersistentTierUnavailable
from tierckptd.persistent_format import data_files
from tierckptd.persistent_retention import persistent_evictions

__all__ = ["MANIFEST_OBJECT", "METADATA_OBJECT", "Drainer", "fingerprint"]

logger = logging.getLogger(__name__)

Key = tuple[str, str]
MANIFEST_OBJECT = "manifest.json"  # the checkpoint's manifest, in the bookkeeping area
METADATA_OBJECT = "metadata.orig"  # the memory tier's (uncompressed) .metadata
READ_CHUNK = 8 << 20


def fingerprint(f: FileRecord) -> str:
    """Identifies a file's bytes (its block checksums) in its upload marker."""
    assert f.checksums is not None
    cs = f.checksums
    return f"{cs.algorithm}:{cs.block_size}:{xxhash.xxh3_128_hexdigest(cs.digests)}"


class _StepAsideForSaves:
    """A file source whose reads wait while a save is writing on this node, so a drain
    in flight does not compete with training; each file waits SAVE_YIELD_MAX at most in
    total, so back-to-back saves cannot stall durability forever."""

    def __init__(self, source: VerifiedFile, catalog: Catalog) -> None:
        self.size = source.size
        self._source = source
        self._catalog = catalog
        self._until = time.monotonic() + SAVE_YIELD_MAX

    def read(self, start: int, length: int) -> bytes | bytearray:
        while self._catalog.saving() and time.monotonic() < self._until:
            time.sleep(0.05)
        return self._source.read(start, length)


class Drainer:
    """Background drain of due checkpoints; one worker thread, jobs retried with backoff."""

    def __init__(
        self,
        catalog: Catalog,
        tier: PersistentTier,
        cluster: Cluster | None = None,
        *,
        keep_last: int = 0,
        keep_every: int = 0,
        poll: float = 0.5,
        max_backoff: float = 10.0,
    ) -> None:
        self.catalog = catalog
        self.tier = tier
        self.cluster = cluster
        self.node_id = catalog.node_id
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.poll = poll
        self.max_backoff = max_backoff
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Key]] = []
        self._when: dict[Key, float] = {}
        self._failures: dict[Key, int] = {}
        self._seq = 0
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---- queue ------------------------------------------------------------------------
    def enqueue(self, namespace: str, checkpoint_id: str, delay: float = 0.0) -> None:
        """Schedule a drain attempt (non-blocking: safe under the catalog lock)."""
        key = (namespace, checkpoint_id)
        when = time.monotonic() + delay
        with self._cv:
            if key in self._when and self._when[key] <= when:
                return
            self._when[key] = when
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, key))
            self._cv.notify()

    def resume(self) -> int:
        """Queue every committed checkpoint that is due and not known durable."""
        keys = self.catalog.due_not_durable()
        for key in keys:
            self.enqueue(*key)
        if keys:
            logger.info("drain: %d committed checkpoints due for %s", len(keys), self.tier.url)
        return len(keys)

    def pending(self) -> list[Key]:
        with self._cv:
            return sorted(self._when)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tierckptd-drain", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _next(self) -> Key | None:
        with self._cv:
            while not self._stop.is_set():
                if self._heap:
                    when, _, key = self._heap[0]
                    if self._when.get(key) != when:
                        heapq.heappop(self._heap)  # superseded entry
                        continue
                    now = time.monotonic()
                    if when <= now:
                        heapq.heappop(self._heap)
                        del self._when[key]
                        return key
                    self._cv.wait(when - now)
                else:
                    self._cv.wait()
            return None

    def _run(self) -> None:
        while (key := self._next()) is not None:
            done = False
            failed = False
            try:
                done = self.drain(*key)
            except PersistentTierUnavailable as e:
                failed = True
                logger.warning("drain of %s/%s delayed: %s", *key, e)
            except Exception:
                failed = True
                logger.exception("drain of %s/%s failed; retrying", *key)
            if done:
                self._failures.pop(key, None)
                continue
            if failed:
                n = self._failures[key] = self._failures.get(key, 0) + 1
                delay = min(self.max_backoff, self.poll * 2.0**n)
            else:
                delay = self.poll
            if not self._stop.is_set():
                self.enqueue(*key, delay=delay)

    # ---- one attempt ------------------------------------------------------------------
    def drain(self, namespace: str, checkpoint_id: str) -> bool:
        """One attempt: upload what this node owns, commit if it holds `.metadata`.

        Returns True when the checkpoint is durable (or gone), False to try again later.
        Raises PersistentTierUnavailable during an outage.
        """
        with self._drain_lock:
            return self._drain(namespace, checkpoint_id)

    def _drain(self, namespace: str, checkpoint_id: str) -> bool:
        if self.catalog.is_durable(namespace, checkpoint_id):
            return True
        try:
            view = self.catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            return True  # deleted meanwhile
        if self.tier.is_durable(namespace, checkpoint_id):
            self.catalog.mark_durable(namespace, checkpoint_id)
            return True
        files = {f.name: f for f in view.files}
        meta = files.get(METADATA_FILE)
        if meta is None:
            logger.error("%s/%s has no .metadata; it cannot be drained", namespace, checkpoint_id)
            return True
        mine = [
            f
            for f in view.files
            if f.name != METADATA_FILE and f.owner_node == self.node_id and f.held
        ]
        committer = meta.owner_node == self.node_id or (not meta.owner_node and meta.held)
        metadata: bytes | None = None
        if mine:
            uploaded = self.tier.uploaded(namespace, checkpoint_id)
            todo = [
                f
                for f in mine
                if (m := uploaded.get(f.name)) is None
                or m.fingerprint != fingerprint(f)
                or m.source_size != f.size
            ]
            if todo:
                metadata = self._metadata(namespace, checkpoint_id)
                self._upload(namespace, checkpoint_id, todo, metadata)
        if not committer:
            return False  # the owner of .metadata commits; the next attempt probes
        if metadata is None:
            metadata = self._metadata(namespace, checkpoint_id)
        self.tier.put_bookkeeping(
            namespace,
            checkpoint_id,
            MANIFEST_OBJECT,
            json.dumps(self.catalog.manifest_document(namespace, checkpoint_id)).encode(),
        )
        self.tier.put_bookkeeping(namespace, checkpoint_id, METADATA_OBJECT, metadata)
        try:
            self.tier.upload_metadata_last(namespace, checkpoint_id, metadata)
        except CheckpointIncomplete as e:
            logger.debug("drain of %s/%s waits for other owners: %s", namespace, checkpoint_id, e)
            return False
        self.catalog.mark_durable(namespace, checkpoint_id)
        self._retain(namespace)
        return True

    def _metadata(self, namespace: str, checkpoint_id: str) -> bytes:
        """The memory tier's `.metadata`, verified (fetched from a peer if not held)."""
        f, path = self.catalog.file_view(namespace, checkpoint_id, METADATA_FILE)
        if not path and self.cluster is not None:
            f, path = self.cluster.ensure_local(namespace, checkpoint_id, METADATA_FILE)
        if not path:
            raise CheckpointNotFound(
                f"{namespace}/{checkpoint_id}: no copy of .metadata on node {self.node_id}"
            )
        assert f.checksums is not None
        what = f"{namespace}/{checkpoint_id}/{METADATA_FILE}"
        with VerifiedFile(path, f.size, f.checksums, what=what) as vf:
            return bytes(vf.read(0, f.size))

    def _upload(
        self, namespace: str, checkpoint_id: str, todo: list[FileRecord], metadata: bytes
    ) -> None:
        items = data_files(metadata) if self.tier.compression == "zstd" else {}
        with ExitStack() as stack:
            uploads = []
            for f in todo:
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
            self.tier.upload_files(namespace, checkpoint_id, uploads)

    def _retain(self, namespace: str) -> None:
        if self.keep_last <= 0:
            return
        durable = self.tier.list_durable(namespace)
        pinned = [v.checkpoint_id for v in self.catalog.list_checkpoints(namespace) if v.pinned]
        try:
            pinned.append(self.catalog.get(namespace).checkpoint_id)  # the newest, always
        except CheckpointNotFound:
            pass
        ordered = [(cid, i) for i, cid in enumerate(durable)]
        for cid in persistent_evictions(ordered, self.keep_last, self.keep_every, pinned):
            self.tier.delete(namespace, cid)
            self.catalog.forget_persistent(namespace, cid)
            logger.info(
                "evicted %s/%s from the persistent tier (persistent_keep_last=%d, "
                "persistent_keep_every=%d)",
                namespace,
                cid,
                self.keep_last,
                self.keep_every,
            )

    # ---- shutdown -----------------------------------------------------------------------
    def emergency(self, deadline: float) -> bool:
        """SIGTERM: drain the newest committed checkpoint not yet durable, for at most
        `deadline` seconds. True when it is durable (or there was nothing to do)."""
        newest: dict[str, Key] = {}
        for view in self.catalog.list_checkpoints():
            newest[view.namespace] = (view.namespace, view.checkpoint_id)
        keys = [k for k in newest.values() if not self.catalog.is_durable(*k)]
        if not keys:
            return True
        end = time.monotonic() + deadline
        ok = True
        for key in keys:
            logger.info("shutdown: draining %s/%s (deadline %.0fs)", *key, deadline)
            while True:
                try:
                    if self.drain(*key):
                        logger.info("shutdown: %s/%s is durable", *key)
                        break
                except Exception as e:
                    logger.warning("shutdown drain of %s/%s: %s", *key, e)
                if time.monotonic() + self.poll > end:
                    logger.error("shutdown: %s/%s not durable within the deadline", *key)
                    ok = False
                    break
                time.sleep(self.poll)
        return ok

    # ---- restore ------------------------------------------------------------------------
    def adopt_durable(self) -> int:
        """Learn the durable checkpoints this node does not know (a replacement cluster
        whose memory tiers are all gone): their manifests come from the bookkeeping
        area, with no file held anywhere; files are fetched from S3 on demand."""
        adopted = 0
        known = set(self.catalog.committed_keys())
        for namespace in self.tier.list_namespaces():
            try:
                ids = self.tier.list_durable(namespace)
            except InvalidName:
                continue
            for checkpoint_id in ids:
                key = (namespace, checkpoint_id)
                if key in known:
                    self.catalog.mark_durable(*key)
                    continue
                raw = self.tier.read_bookkeeping(namespace, checkpoint_id, MANIFEST_OBJECT)
                if raw is None:
                    logger.warning("%s/%s is durable but has no manifest; skipped", *key)
                    continue
                try:
                    rec = manifest_from_json(json.loads(raw))
                except (ManifestError, ValueError) as e:
                    logger.error("%s/%s: bad manifest in the persistent tier: %s", *key, e)
                    continue
                if rec.key != key:
                    continue
                for f in rec.files.values():
                    f.held = False
                    f.owner_node = ""
                    f.replica_nodes = []
                if self.catalog.publish(rec):
                    self.catalog.mark_durable(*key)
                    adopted += 1
        if adopted:
            logger.info("adopted %d durable checkpoints from %s", adopted, self.tier.url)
        return adopted

    def restore_file(self, namespace: str, checkpoint_id: str, name: str) -> int:
        """Download one file from the persistent tier into the memory tier, decompressed
        back to the original bytes and verified block by block; returns bytes taken.
        Call with the cluster's file lock held (`Cluster.ensure_local` does)."""
        what = f"{namespace}/{checkpoint_id}/{name} from {self.tier.url}"
        f, _ = self.catalog.file_view(namespace, checkpoint_id, name)
        assert f.checksums is not None
        if name == METADATA_FILE:
            data = self.tier.read_bookkeeping(namespace, checkpoint_id, METADATA_OBJECT)
            if data is None:
                raise CheckpointNotFound(f"{what}: no original .metadata in the bookkeeping")
            chunks: Iterator[tuple[int, bytes]] = iter([(0, data)])
        else:
            marker = self.tier.uploaded(namespace, checkpoint_id).get(name)
            if marker is None:
                raise CheckpointNotFound(f"{what}: not in the persistent tier")
            chunks = self._original_chunks(namespace, checkpoint_id, name, marker.index, f.size)
        taken = install_copy(self.catalog, namespace, checkpoint_id, name, chunks, what=what)
        if not taken:
            return 0
        logger.info("restored %s (%d bytes)", what, f.size)
        return f.size

    def _original_chunks(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        index: dict[int, tuple[int, int]] | None,
        size: int,
    ) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) of the original file, in order, from the stored object."""
        if index is None:
            for start in range(0, size, READ_CHUNK):
                n = min(READ_CHUNK, size - start)
                yield start, self.tier.read_range(namespace, checkpoint_id, name, start, n)
            return
        olds = sorted(index)
        position = 0
        for i, old in enumerate(olds):
            if old > position:  # bytes outside every item (none in DCP files): zeros
                yield position, bytes(old - position)
                position = old
            new_offset, new_length = index[old]
            expected_end = olds[i + 1] if i + 1 < len(olds) else size
            d = zstandard.ZstdDecompressor().decompressobj()
            for start in range(new_offset, new_offset + new_length, READ_CHUNK):
                n = min(READ_CHUNK, new_offset + new_length - start)
                try:
                    data = d.decompress(
                        self.tier.read_range(namespace, checkpoint_id, name, start, n)
                    )
                except zstandard.ZstdError as e:
                    raise ChecksumMismatch(
                        f"{namespace}/{checkpoint_id}/{name}: the stored item at {old} is "
                        f"corrupt ({e})"
                    ) from None
                if data:
                    if position + len(data) > expected_end:
                        raise ChecksumMismatch(
                            f"{namespace}/{checkpoint_id}/{name}: item at {old} decompresses "
                            "past the next item"
                        )
                    yield position, data
                    position += len(data)
            if not d.eof:
                raise ChecksumMismatch(
                    f"{namespace}/{checkpoint_id}/{name}: truncated zstd frame at {new_offset}"
                )
        if position < size:
            yield position, bytes(size - position)
