"""The seed's data model on tierckpt checkpoints: one model for every route.

- namespace -> tierckpt namespace; step N -> checkpoint ``step_N``;
- data rank R's blob -> the file ``__R_0.distcp`` of that checkpoint, byte for byte;
- the metadata blob (rank ``num_ranks - 1``) -> kept byte-exact as
  ``.sagemaker_metadata_<rank>`` and converted (allow-list decoder, never
  ``pickle.loads``; above 1 MiB in the drain's resource-limited child,
  `tierckptd.persistent.decode`) into the stock DCP ``.metadata`` naming those files.

A step is committed when its metadata blob arrives and every data file it names is
held on some node (the cluster commit asks the peers); only committed steps are
listed or served, so ``latest`` never names a step whose data is missing, and the
persistent tier's steps are listed and restored like any other. A namespace's
``steps_retained`` is its memory window in the daemon's own retention
(`Catalog.set_memory_keep_last`): each step's manifest records it, so every node
(a replacement one too) keeps the same newest steps in memory and learns the value back
for the namespace's config; the persistent tier keeps what ``[retention]`` says.

A blob sent again for a step that holds it already (a retry, a restarted job saving the
same step) is acknowledged when its bytes are the stored ones; other bytes are refused
(409, naming the step and how to free it): a step is written once.

Blob bodies go from the socket into the memory-tier file in 1 MiB chunks (one buffer,
reused), hashed on the way for the client's xxh3-128 and for the daemon's block
checksums; the size is reserved against the budget before the first byte. A body whose
digest differs from ``Shard-Meta``, that ends early, or that cannot fit leaves nothing:
this node's unfinished save of that step is dropped (the step could not commit).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

import xxhash
from tierckpt.checksum import DEFAULT_BLOCK_SIZE, BlockChecksums, checksum_bytes
from tierckpt.dcp_metadata import MAX_METADATA_BYTES
from tierckpt.errors import (
    CheckpointExists,
    CheckpointIncomplete,
    CheckpointNotFound,
    ChecksumMismatch,
    InvalidArgument,
    TierckptError,
    UnsafeMetadata,
)
from tierckpt.memory_files import ChecksummingWriter
from tierckpt.names import METADATA_FILE
from tierckpt.trust import Trust as TrustState

from tierckptd.model import CheckpointView, State
from tierckptd.persistent.decode import decode
from tierckptd.sagemaker.adapter import SeedDaemon
from tierckptd.sagemaker.protocol import (
    DEFAULT_STEPS_RETAINED,
    checkpoint_id_of,
    data_file,
    metadata_file,
    metadata_rank,
    step_of,
)

__all__ = ["Blob", "NamespaceConfig", "ResetRefused", "SeedCheckpoints"]

logger = logging.getLogger(__name__)

CHUNK = 1 << 20
_DATA_FILE = re.compile(r"__([0-9]{1,7})_0\.distcp")
ReadInto = Callable[[memoryview], int]
"""Fills a buffer from the request body; the bytes read (0 at its end)."""


class ResetRefused(TierckptError):
    """`cluster/reset` while `[listen] sagemaker_allow_reset` is false (403)."""


class BodyTooLarge(InvalidArgument):
    """A body larger than the API takes for that blob (413)."""


class BodyIncomplete(InvalidArgument):
    """The connection ended before Content-Length bytes (400)."""


@dataclass(frozen=True)
class NamespaceConfig:
    num_ranks: int  # data ranks + the metadata rank (the client's world_size + 1)
    steps_retained: int

    def to_json(self) -> dict[str, int]:
        return {"num_ranks": self.num_ranks, "steps_to_retain_per_rank": self.steps_retained}


@dataclass(frozen=True)
class Blob:
    """A committed blob to send: its local, verified file and the client's digest."""

    path: str
    size: int
    digest: bytes  # xxh3-128 of the whole body (Shard-Meta)


class SeedCheckpoints:
    """The API's operations on one daemon (thread-safe; the HTTP layer maps errors)."""

    def __init__(self, daemon: SeedDaemon, *, allow_reset: bool = False) -> None:
        self.daemon = daemon
        self.allow_reset = allow_reset
        self._lock = threading.Lock()
        self._configs: dict[str, NamespaceConfig] = {}

    # ---- namespaces --------------------------------------------------------------------
    def namespace(self, namespace: str, *, relist: bool = True) -> NamespaceConfig | None:
        """Its config: created here, else learnt from a committed step that any node (or,
        with `relist`, the persistent tier) holds, so every node answers for the job; the
        window the step recorded is set here again, so this node's next commits of the
        namespace (a restarted coordinator's) record it too."""
        with self._lock:
            config = self._configs.get(namespace)
        if config is not None:
            return config
        for view in reversed(self.daemon.committed(namespace, relist=relist)):
            rank = _metadata_rank_of(view)
            if rank is not None:
                kept = view.memory_keep_last or DEFAULT_STEPS_RETAINED
                with self._lock:  # kept: the coordinator's metadata POST needs it next
                    config = self._configs.setdefault(namespace, NamespaceConfig(rank + 1, kept))
                self.daemon.set_memory_keep_last(namespace, config.steps_retained)
                return config
        return None

    def create_namespace(
        self, namespace: str, num_ranks: int, steps_retained: int
    ) -> NamespaceConfig:
        """Create (or, for a job restarted at another world size, replace) the config;
        idempotent, unlike the seed's 409."""
        if num_ranks < 2:
            raise InvalidArgument(
                f"num_ranks = {num_ranks}: a namespace has at least one data rank and the "
                "metadata rank"
            )
        config = NamespaceConfig(num_ranks, steps_retained)
        self.daemon.set_memory_keep_last(namespace, steps_retained)  # validates it
        with self._lock:
            self._configs[namespace] = config
        logger.info(
            "sagemaker API: namespace %s, %d ranks (metadata rank %d), steps_retained %d",
            namespace,
            num_ranks,
            num_ranks - 1,
            steps_retained,
        )
        return config

    def delete_namespace(self, namespace: str) -> int:
        """Every committed step of the namespace removed cluster-wide; the count."""
        with self._lock:
            known = self._configs.pop(namespace, None) is not None
        removed = 0
        for view in self.daemon.committed(namespace):
            if step_of(view.checkpoint_id) is not None:
                try:
                    self.daemon.remove(namespace, view.checkpoint_id)
                    removed += 1
                except CheckpointNotFound:
                    pass
        if not (known or removed):
            raise CheckpointNotFound(f"namespace {namespace} has no SageMaker checkpoints here")
        return removed

    def reset(self) -> int:
        """`cluster/reset`: every namespace the API serves, removed cluster-wide."""
        if not self.allow_reset:
            raise ResetRefused(
                "cluster/reset is refused: it would delete every job's checkpoints on every "
                "node; an operator enables it with [listen] sagemaker_allow_reset = true"
            )
        with self._lock:
            names = set(self._configs)
        names |= {
            ns
            for ns in self.daemon.namespaces()
            if any(_metadata_rank_of(v) is not None for v in self.daemon.committed(ns))
        }
        removed = 0
        for ns in sorted(names):
            try:
                removed += self.delete_namespace(ns)
            except CheckpointNotFound:
                pass
        return removed

    # ---- saves -------------------------------------------------------------------------
    def put(
        self, namespace: str, rank: int, step: int, size: int, digest: bytes, body: ReadInto
    ) -> None:
        """Store one blob (acknowledged once verified against `digest` and sealed); the
        metadata rank's commits the step."""
        config = self.namespace(namespace, relist=False)  # no S3 listing on the save path
        if config is not None and rank >= config.num_ranks:
            raise InvalidArgument(
                f"rank {rank} is out of range for namespace {namespace}: it has "
                f"{config.num_ranks} ranks (data 0..{config.num_ranks - 2}, metadata "
                f"{config.num_ranks - 1})"
            )
        stored = self._stored_digest(namespace, rank, step)
        if stored is not None:
            self._put_again(namespace, rank, step, size, digest, body, stored)
        # A node that has not seen the namespace (the coordinator created it on its own
        # node) takes data blobs: only the coordinator, which created it, sends metadata.
        elif config is not None and rank == config.num_ranks - 1:
            self._put_metadata(namespace, rank, step, size, digest, body)
        else:
            self._put_data(namespace, rank, step, size, digest, body)

    def _stored_digest(self, ns: str, rank: int, step: int) -> bytes | None:
        """The xxh3-128 of rank `rank`'s blob this step already holds (committed: from
        any tier; an unfinished save: this node's sealed copy), verified; None if none.

        Raises:
            CheckpointExists: the step is committed without a blob of that rank.
        """
        cid = checkpoint_id_of(step)
        state = self.daemon.state(ns, cid)
        if state is State.COMMITTED:
            blob = self.get(ns, rank, step)
            if blob is None:
                raise CheckpointExists(
                    f"{ns} step {step} is committed without a blob of rank {rank}; a step "
                    f"is written once: save a new step, or remove step {step} first "
                    f"(`tierckpt rm {ns} {cid}`)"
                )
            return blob.digest
        if state is not State.WRITING:
            return None
        for name in (data_file(rank), metadata_file(rank)):
            held = self.daemon.held_file(ns, cid, name)
            checksums = held[0].checksums if held is not None else None
            if held is None or checksums is None:
                continue
            try:
                return _verified_digest(held[1], held[0].size, checksums, f"{ns}/{cid}/{name}")
            except FileNotFoundError:
                return None  # the unfinished save was collected meanwhile
        return None

    def _put_again(
        self,
        ns: str,
        rank: int,
        step: int,
        size: int,
        digest: bytes,
        body: ReadInto,
        stored: bytes,
    ) -> None:
        """A blob the step holds already: the body is read (so the client gets the
        answer, not a reset connection) and checked; the same bytes are acknowledged,
        other bytes refused."""
        whole = xxhash.xxh3_128()
        _stream(body, size, whole.update)
        what = f"{ns}/{rank}/{step}"
        _check_digest(whole.digest(), digest, what)
        if digest == stored:
            logger.info("sagemaker API: %s sent again with the stored bytes: acknowledged", what)
            return
        cid = checkpoint_id_of(step)
        if self.daemon.state(ns, cid) is State.COMMITTED:
            how = (
                f"step {step} is committed and a committed step is written once: save "
                f"under a new step, or remove step {step} on every node first "
                f"(DELETE /v1/cp/checkpoints/{ns}/{rank}/{step}, or `tierckpt rm {ns} {cid}`) "
                "and save it again"
            )
        else:
            how = (
                f"an unfinished save of step {step} (its metadata blob never arrived) holds "
                f"it on this node: `tierckpt rm {ns} {cid}` drops that save, as the daemon "
                "does once it has been idle for [memory] abandon_after"
            )
        raise CheckpointExists(
            f"{ns} step {step}: rank {rank}'s blob is already stored with other bytes "
            f"(xxh3-128 {stored.hex()}, this body's {digest.hex()}); nothing was changed; " + how
        )

    def _put_data(
        self, ns: str, rank: int, step: int, size: int, digest: bytes, body: ReadInto
    ) -> None:
        cid, name = checkpoint_id_of(step), data_file(rank)
        opened = self.daemon.begin(ns, cid, rank)
        written = False
        try:
            path = self.daemon.open_file(ns, cid, name, rank, size)
            written = True
            fd = os.open(path, os.O_WRONLY)
            try:
                writer = ChecksummingWriter(fd, DEFAULT_BLOCK_SIZE)
                whole = xxhash.xxh3_128()

                def sink(view: memoryview) -> None:
                    whole.update(view)
                    writer.write(view)

                _stream(body, size, sink)
                length, checksums = writer.finish()
            finally:
                os.close(fd)
            _check_digest(whole.digest(), digest, f"{ns}/{rank}/{step}")
            self.daemon.commit_file(ns, cid, name, rank, length, checksums)
        except BaseException:
            if opened or written:  # nothing of a refused blob stays (see the module doc)
                self.daemon.abort(ns, cid)
            raise

    def _put_metadata(
        self,
        ns: str,
        rank: int,
        step: int,
        size: int,
        digest: bytes,
        body: ReadInto,
    ) -> None:
        if size > MAX_METADATA_BYTES:
            raise BodyTooLarge(
                f"the metadata blob of {ns} step {step} has {size} bytes, more than the "
                f"{MAX_METADATA_BYTES} a checkpoint's metadata may have"
            )
        raw = bytearray(size)
        _stream(body, size, _filler(raw))
        what = f"{ns}/{rank}/{step} (metadata)"
        _check_digest(xxhash.xxh3_128_digest(raw), digest, what)
        blob = bytes(raw)  # one immutable copy: decoded, and kept byte-exact for the client
        del raw
        # The allow-list decoder, in a resource-limited child above 1 MiB (as the drain's).
        decoded = decode(blob, what=what, seed=True)
        stock = decoded.rewritten
        items = {_rank_of_data_file(path, what) for path in decoded.files}
        if stock is None:  # decode() returns the rewrite whenever `seed` is set
            raise UnsafeMetadata(f"{what}: the decoder returned no converted .metadata")
        bad = sorted(r for r in items if r >= rank)
        if bad:
            raise InvalidArgument(
                f"{what}: its items name data rank(s) {bad[:5]}, but the namespace's data "
                f"ranks are 0..{rank - 1}"
            )
        cid = checkpoint_id_of(step)
        self.daemon.begin(ns, cid, rank)
        try:
            own = (
                (metadata_file(rank), blob),
                (METADATA_FILE, stock),
            )
            for name, data in own:
                path = self.daemon.open_file(ns, cid, name, rank, len(data))
                _write_file(path, data)
                self.daemon.commit_file(ns, cid, name, rank, len(data), checksums_of(data))
            required = [data_file(r) for r in sorted(items)] + [name for name, _ in own]
            self.daemon.commit(ns, cid, required)
        except BaseException:
            self.daemon.abort(ns, cid)  # the step cannot commit: nothing of it stays here
            raise

    # ---- loads -------------------------------------------------------------------------
    def latest(self, namespace: str, limit: int) -> list[int]:
        """Committed steps, newest first: only steps whose metadata blob is here and whose
        files are held (never LOST), including those only the persistent tier holds;
        never a step marked bad (`tierckpt mark`)."""
        steps = {
            step
            for v in self.daemon.committed(namespace)
            if (step := step_of(v.checkpoint_id)) is not None
            and _metadata_rank_of(v) is not None
            and v.state is not State.LOST
            and v.trust is not TrustState.BAD
            and "foreign" not in v.tiers  # never a peer's the namespace's writers did not save
        }
        return sorted(steps, reverse=True)[:limit]

    def get(self, namespace: str, rank: int, step: int) -> Blob | None:
        """A committed blob, restored through the restore chain when this node does not
        hold it, and verified block by block as its digest is computed; None if absent."""
        cid = checkpoint_id_of(step)
        view = self.daemon.lookup(namespace, cid)
        if view is None or view.state is State.LOST:
            return None
        names = {f.name for f in view.files}
        name = data_file(rank) if data_file(rank) in names else metadata_file(rank)
        if name not in names:
            return None
        f, path = self.daemon.ensure_local(namespace, cid, name)
        if f.checksums is None:
            raise CheckpointIncomplete(f"{namespace}/{cid}/{name} has no checksums on this node")
        return Blob(
            path, f.size, _verified_digest(path, f.size, f.checksums, f"{namespace}/{cid}/{name}")
        )

    def delete(self, namespace: str, rank: int, step: int) -> int:
        """DELETE of a blob: tierckpt checkpoints are immutable units, so the step goes,
        on every node and in the persistent tier."""
        cid = checkpoint_id_of(step)
        view = self.daemon.lookup(namespace, cid)
        if view is None:
            raise CheckpointNotFound(f"{namespace} has no committed step {step}")
        names = {f.name for f in view.files}
        if data_file(rank) not in names and metadata_file(rank) not in names:
            raise CheckpointNotFound(f"{namespace} step {step} has no blob of rank {rank}")
        return self.daemon.remove(namespace, cid)


def _rank_of_data_file(path: str, what: str) -> int:
    match = _DATA_FILE.fullmatch(path)
    if match is None:
        raise UnsafeMetadata(f"{what}: an item names {path[:64]!r}, not a rank's blob")
    return int(match.group(1))


def _metadata_rank_of(view: CheckpointView) -> int | None:
    for f in view.files:
        rank = metadata_rank(f.name)
        if rank is not None:
            return rank
    return None


def checksums_of(data: bytes) -> BlockChecksums:
    return checksum_bytes(data, DEFAULT_BLOCK_SIZE)


def _filler(target: bytearray) -> Callable[[memoryview], None]:
    position = 0

    def fill(view: memoryview) -> None:
        nonlocal position
        target[position : position + view.nbytes] = view
        position += view.nbytes

    return fill


def _stream(body: ReadInto, size: int, sink: Callable[[memoryview], object]) -> None:
    """Exactly `size` body bytes to `sink`, through one reused 1 MiB buffer."""
    buffer = memoryview(bytearray(min(CHUNK, max(size, 1))))
    left = size
    while left:
        got = body(buffer[: min(left, buffer.nbytes)])
        if not got:
            raise BodyIncomplete(f"the request body ended after {size - left} of its {size} bytes")
        sink(buffer[:got])
        left -= got


def _check_digest(actual: bytes, expected: bytes, what: str) -> None:
    if actual != expected:
        raise ChecksumMismatch(
            f"{what}: the body's xxh3-128 is {actual.hex()}, its Shard-Meta says "
            f"{expected.hex()}; nothing was stored"
        )


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view) :]
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _verified_digest(path: str, size: int, checksums: BlockChecksums, what: str) -> bytes:
    """One pass over the sealed file, a block at a time through one reused buffer: each
    block checked against the daemon's checksums, and the whole body's xxh3-128 for
    Shard-Meta (the body itself is then sent from the page cache, `os.sendfile`)."""
    whole = xxhash.xxh3_128()
    step = checksums.block_size
    buffer = memoryview(bytearray(min(step, max(size, 1))))
    fd = os.open(path, os.O_RDONLY)
    try:
        for block, start in enumerate(range(0, size, step)):
            want = min(step, size - start)
            got = os.preadv(fd, [buffer[:want]], start)
            if got != want:
                raise ChecksumMismatch(f"{what}: the file ends at {start + got}, not {size}")
            piece = buffer[:want]
            checksums.check_block(block, xxhash.xxh3_128_digest(piece), what=what)
            whole.update(piece)
    finally:
        os.close(fd)
    return whole.digest()
