"""TieredStorageReader: DCP loads from the local tierckptd's memory tier.

Copies per byte on `dcp.load`: one. For each tensor item the reader parses the
torch.save framing (a few KiB), then `preadv`s the needed bytes from shared memory
straight into the destination tensor and verifies the covering checksum blocks while
they are in cache. A file's items are read as one batch, each pool thread streaming runs
of consecutive blocks. Destinations the bytes cannot land in (strided views, GPU
tensors) get a host landing buffer (pinned for a GPU) and one more copy; items that
cannot be read as raw bytes (non-contiguous slices, compressed items, converted dtypes)
go through a staging buffer and ``torch.load``."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import io
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt.daemon_client import CheckpointInfo, DaemonClient, FileEntry
from tierckpt.dcp_metadata import load_metadata
from tierckpt.errors import (
    CHECKPOINT_LOST_PREFIX,
    CheckpointIncomplete,
    CheckpointLost,
    ChecksumMismatch,
    InvalidArgument,
    TierckptError,
    TierUnavailable,
)
from tierckpt.memory_files import VerifiedFile, wait_all
from tierckpt.names import METADATA_FILE, check_checkpoint_id, check_namespace, is_checkpoint_id
from tierckpt.saved_tensor import parse_saved_tensor
from tierckpt.trust import Trust

__all__ = ["TieredStorageReader"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass
class _Started:
    """One file's reads in flight: their futures, and the targets to commit after."""

    jobs: list[CFuture[None]] = dataclasses.field(default_factory=list)
    resolved: list[tuple[ReadItem, torch.Tensor]] = dataclasses.field(default_factory=list)


def _is_direct(target: torch.Tensor) -> bool:
    """Whether the file's bytes can be read straight into `target`'s memory."""
    return target.device.type == "cpu" and target.is_contiguous()


def _landing_for(target: torch.Tensor) -> torch.Tensor:
    """A contiguous host buffer for a destination the file cannot be read into directly
    (a strided CPU view, or a GPU tensor: then pinned, so the copy to the device is one
    DMA). The bytes are verified in it and copied once more, to the destination."""
    pin = target.device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(target.shape, dtype=target.dtype, pin_memory=pin)


def _writable_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (any dtype)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _lost_message(info: CheckpointInfo) -> str:
    """Why a LOST checkpoint cannot be loaded: its files with no copy left, and the nodes
    that held them (each answered without them) and the persistent tier (not there)."""
    lost = list(info.lost_files)
    holders: dict[str, None] = {}
    for name in lost:
        try:
            entry = info.file(name)
        except KeyError:
            continue
        holders.update(dict.fromkeys(n for n in (entry.owner_node, *entry.replica_nodes) if n))
    shown = ", ".join(lost[:10]) + (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
    return (
        f"{CHECKPOINT_LOST_PREFIX}{info.namespace}/{info.checkpoint_id} is LOST: no copy of "
        f"{shown or 'some file'} is left on any tier (tried nodes "
        f"{', '.join(holders) or 'none'}: each answered without it; the persistent tier does "
        "not hold the checkpoint); load an older checkpoint (checkpoint_id=None picks the "
        "newest complete one)"
    )


class TieredStorageReader(StorageReader):
    """A DCP `StorageReader` that restores from the local tierckptd.

    Args:
        namespace: the training job whose checkpoints to read.
        daemon: the local daemon's address; default ``$TIERCKPT_DAEMON``, else the
            default unix socket.
        io_threads: threads reading and hashing blocks (preadv and xxh3 release the
            GIL); a few more than cores cost nothing, as kernel page copies stall on memory.
        newest: what ``checkpoint_id=None`` loads: "committed", the newest committed
            checkpoint; "verified", the newest one marked verified (`tierckpt.mark`).

    ``dcp.load(sd, checkpoint_id=None, storage_reader=...)`` loads the newest committed
    checkpoint of the namespace that is not LOST and not marked bad (it logs which, and
    warns about newer LOST ones: `lost_newer`); every rank must resolve the same one,
    which the coordinator checks. Loading a LOST checkpoint raises `CheckpointLost`.
    """

    def __init__(
        self,
        namespace: str,
        *,
        daemon: str | None = None,
        io_threads: int = 4,
        newest: Literal["committed", "verified"] = "committed",
    ) -> None:
        super().__init__()
        if newest not in ("committed", "verified"):
            raise InvalidArgument(
                f"newest={str(newest)[:32]!r}: expected 'committed' or 'verified'"
            )
        self.newest = newest
        self.namespace = check_namespace(namespace)
        self.client = DaemonClient(daemon)
        self.io_threads = io_threads
        self._requested_id: str | None = None
        self._info: CheckpointInfo | None = None
        self._fetched: dict[str, FileEntry] = {}  # entries the daemon made local for us
        # Where each file of the last load came from: "memory" (this node's tier),
        # "fetched" (made local by the daemon from another tier), "repaired" (a corrupt
        # local copy replaced). For logs and demos.
        self.sources: dict[str, str] = {}
        # Checkpoints newer than the one a `checkpoint_id=None` load picked, skipped
        # because they are LOST (some file has no copy on any tier).
        self.lost_newer: tuple[str, ...] = ()
        self.storage_data: dict[Any, Any] = {}
        self.load_id = dcp_filesystem._generate_uuid()
        self._extensions = ExtensionRegistry()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_info"] = None
        state["_fetched"] = {}
        return state

    # --- identity ----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self._info = None
        self._fetched = {}
        self.sources = {}
        self.lost_newer = ()
        self._requested_id = check_checkpoint_id(str(checkpoint_id)) if checkpoint_id else None
        self.load_id = dcp_filesystem._generate_uuid()

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint being loaded (the newest committed one when none was named)."""
        if self._info is not None:
            return self._info.checkpoint_id
        return self._requested_id or ""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_checkpoint_id(checkpoint_id)

    def _checkpoint(self) -> CheckpointInfo:
        if self._info is None:
            info = self.client.get_checkpoint(
                self.namespace, self._requested_id, verified=self.newest == "verified"
            )
            if info.state == "LOST" and METADATA_FILE in info.lost_files:
                raise CheckpointLost(_lost_message(info))
            if self._requested_id is None:
                self._say_newest(info)
            self._info = info
        return self._info

    def _say_newest(self, info: CheckpointInfo) -> None:
        """Log which checkpoint a `checkpoint_id=None` load restores, and warn about the
        newer ones it skipped because they are LOST."""
        try:
            rows = self.client.list_checkpoints(self.namespace)
        except TierckptError as e:  # only for the log line: the load goes on
            logger.info("restoring %s/%s, the newest (%s)", info.namespace, info.checkpoint_id, e)
            return
        # The daemon's order: the sequence (a Lamport-style counter), never wall time.
        order = (info.sequence, info.committed_unix)
        lost = [c for c in rows if c.state == "LOST" and (c.sequence, c.committed_unix) > order]
        self.lost_newer = tuple(c.checkpoint_id for c in lost)
        bad = [
            c.checkpoint_id
            for c in rows
            if c.trust is Trust.BAD and (c.sequence, c.committed_unix) > order
        ]
        if bad:
            logger.warning(
                "restoring %s/%s: passed over the newer %s, marked bad (tierckpt mark)",
                info.namespace,
                info.checkpoint_id,
                ", ".join(bad[:10]),
            )
        if lost:
            logger.warning(
                "restoring %s/%s, the newest complete checkpoint: the newer %s LOST (no copy "
                "of some file on any tier: %s)",
                info.namespace,
                info.checkpoint_id,
                ", ".join(self.lost_newer) + (" is" if len(lost) == 1 else " are"),
                "; ".join(f"{c.checkpoint_id}: {', '.join(c.lost_files[:5])}" for c in lost[:5]),
            )
        else:
            logger.info(
                "restoring %s/%s, the newest checkpoint", info.namespace, info.checkpoint_id
            )

    def _open(self, name: str, *, repair: bool = False) -> VerifiedFile:
        """A verified local copy of `name`. A file this node lacks (a replacement node, a
        resharded load) or whose copy failed verification (`repair`) is first made local
        by the daemon from a peer that holds a valid copy."""
        info = self._checkpoint()
        entry = self._fetched.get(name) or info.file(name)
        what = f"{info.namespace}/{info.checkpoint_id}/{name}"
        if not repair and entry.local_path and entry.checksums is not None:
            try:
                opened = entry.open_verified(what)
            except FileNotFoundError:
                pass  # evicted or lost since GetCheckpoint: fetch it like a missing file
            else:
                self.sources.setdefault(name, "fetched" if name in self._fetched else "memory")
                return opened
        entry = self.client.ensure_local(info.namespace, info.checkpoint_id, name, repair=repair)
        self.sources[name] = "repaired" if repair else "fetched"
        return entry.open_verified(what)

    def _with_repair(self, name: str, read: Callable[[VerifiedFile], T]) -> T:
        """Run `read` on the local copy; on a checksum mismatch have the daemon replace the
        copy from a peer (counted and logged there) and read once more."""
        with self._open(name) as f:
            try:
                return read(f)
            except ChecksumMismatch as e:
                mismatch = e
        return self._read_repaired(name, mismatch, read)

    def _read_repaired(
        self, name: str, mismatch: ChecksumMismatch, read: Callable[[VerifiedFile], T]
    ) -> T:
        logger.warning("%s; asking tierckptd to repair it from a peer", mismatch)
        try:
            repaired = self._open(name, repair=True)
        except TierUnavailable as e:
            # A tier that may hold a valid copy is down: retryable, not data loss.
            raise TierUnavailable(f"{e} (the local copy failed verification: {mismatch})") from e
        except CheckpointLost:
            raise  # no copy anywhere, not a checksum error
        except TierckptError as e:
            raise ChecksumMismatch(f"{mismatch}; no valid copy could be fetched: {e}") from e
        with repaired as f:
            return read(f)

    # --- DCP protocol -----------------------------------------------------------------
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        raw = self._with_repair(METADATA_FILE, lambda f: f.read(0, f.size))
        # Ranks and peers wrote these bytes: decode with the allow-list, never pickle.
        what = f"{self.namespace}/{self.checkpoint_id}/{METADATA_FILE}"
        metadata = load_metadata(raw, what=what)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        info = self._checkpoint()
        if info.state == "LOST":
            # Here, not in read_metadata: DCP keeps this error's type (it flattens a
            # read_metadata error into an AssertionError's message).
            raise CheckpointLost(_lost_message(info))
        if metadata.storage_data is None:
            raise CheckpointIncomplete(
                f"{self.namespace}/{self.checkpoint_id}: .metadata has no storage_data"
            )
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Sequential order within each file; carry the resolved id so the coordinator can
        # check that every rank loads the same checkpoint.
        items = sorted(
            plan.items,
            key=lambda r: (
                self.storage_data[r.storage_index].relative_path,
                self.storage_data[r.storage_index].offset,
            ),
        )
        return LoadPlan(items, storage_data=self.checkpoint_id, planner_data=plan.planner_data)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        resolved = {p.storage_data for p in plans if p.storage_data is not None}
        if len(resolved) > 1:
            raise CheckpointIncomplete(
                f"ranks resolved different checkpoints of {self.namespace} ({sorted(resolved)}): a save "
                "committed during the load; retry, or pass checkpoint_id= explicitly"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """One pool of `io_threads` streams every file's blocks into the destinations;
        planner calls stay on this thread, in plan order.

        All files are started before any is waited for, so the pool never drains
        between files (nor idles while this thread parses the next file's framing)."""
        per_file: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        with ThreadPoolExecutor(
            max(1, self.io_threads), thread_name_prefix="tierckpt-read"
        ) as pool:
            self._fetch_missing(list(per_file), pool)
            started: list[tuple[str, VerifiedFile, _Started]] = []

            def repair(name: str, f: VerifiedFile, mismatch: ChecksumMismatch) -> None:
                f.close()  # none of its reads is running: wait_all waited for them
                read = functools.partial(
                    self._read_items, items=per_file[name], planner=planner, pool=pool
                )
                self._read_repaired(name, mismatch, read)

            try:
                for name, items in per_file.items():
                    f = self._open(name)
                    try:
                        started.append((name, f, self._start_items(f, items, planner, pool)))
                    except ChecksumMismatch as e:
                        repair(name, f, e)
                    except BaseException:
                        f.close()
                        raise
                for name, f, job in started:
                    try:
                        self._finish_items(job, planner)
                    except ChecksumMismatch as e:
                        repair(name, f, e)
            finally:
                for _, f, job in started:
                    with contextlib.suppress(Exception):
                        wait_all(job.jobs)  # never leave a worker writing into a target
                    f.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _fetch_missing(self, names: list[str], pool: ThreadPoolExecutor) -> None:
        """Files this node lacks (a replacement node, a resharded load) are fetched by the
        daemon from peers all at once, in parallel, before the reads start."""
        info = self._checkpoint()
        missing = [
            n
            for n in names
            if n not in self._fetched
            and (not info.file(n).local_path or info.file(n).checksums is None)
        ]
        fetch = functools.partial(self.client.ensure_local, info.namespace, info.checkpoint_id)
        for name, entry in zip(missing, pool.map(fetch, missing), strict=True):
            self._fetched[name] = entry

    def _read_items(
        self, f: VerifiedFile, items: list[ReadItem], planner: LoadPlanner, pool: ThreadPoolExecutor
    ) -> None:
        self._finish_items(self._start_items(f, items, planner, pool), planner)

    def _start_items(
        self, f: VerifiedFile, items: list[ReadItem], planner: LoadPlanner, pool: ThreadPoolExecutor
    ) -> _Started:
        """Start reading one file's items. Those read straight into their destination form
        one batch of segments: blocks two items share are read and hashed once, and each
        of the pool's threads streams runs of consecutive blocks. Items that need a landing
        buffer or torch.load are one job each beside it (so at most `io_threads` such
        buffers exist at a time)."""
        started = _Started()
        batched: set[MetadataIndex] = set()  # saved items in the batch: framing read once
        segments: list[tuple[int, memoryview]] = []
        jobs = started.jobs
        try:
            for item in items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(self._item_bytes(f, item)))
                    continue
                target = planner.resolve_tensor(item).detach()
                started.resolved.append((item, target))
                direct = self._direct_segments(f, item, target)
                if direct is None:
                    jobs.append(pool.submit(self._read_staged, f, item, target))
                elif _is_direct(target) and item.storage_index not in batched:
                    batched.add(item.storage_index)
                    segments += direct(_writable_view(target))
                elif _is_direct(target):  # another piece of a batched item (resharding)
                    jobs.append(pool.submit(f.read_segments, direct(_writable_view(target))))
                else:
                    jobs.append(pool.submit(self._read_landed, f, direct, target))
            jobs += f.start_segments(segments, pool)
        except BaseException:
            with contextlib.suppress(Exception):
                wait_all(jobs)  # never leave a worker writing into a target
            raise
        return started

    @staticmethod
    def _finish_items(started: _Started, planner: LoadPlanner) -> None:
        """Wait for a file's reads (all of them, also when one fails), then commit."""
        wait_all(started.jobs)
        for item, target in started.resolved:
            planner.commit_tensor(item, target)

    # --- one item -----------------------------------------------------------------------
    def _item_bytes(self, f: VerifiedFile, item: ReadItem) -> bytes | bytearray:
        """The item's stored bytes, verified, with any transform (compression) undone."""
        info = self.storage_data[item.storage_index]
        raw = f.read(info.offset, info.length)
        return self._untransform(item, info, raw) if info.transform_descriptors else raw

    def _direct_segments(
        self, f: VerifiedFile, item: ReadItem, target: torch.Tensor
    ) -> Callable[[memoryview], list[tuple[int, memoryview]]] | None:
        """How to read `item` as raw bytes into a contiguous buffer shaped like `target`:
        a function from that buffer to the file segments to read; None when the item
        must be decoded by torch.load (a transform, a non-contiguous slice, a dtype or
        shape DCP converts)."""
        info = self.storage_data[item.storage_index]
        if info.transform_descriptors:
            return None
        layout = parse_saved_tensor(f.fileno(), info.offset, info.length)
        span = layout.contiguous_range(tuple(item.storage_offsets), tuple(item.lengths))
        if (
            span is None
            or target.dtype != layout.meta.dtype
            or tuple(target.shape) != tuple(item.lengths)
        ):
            return None
        start, nbytes = span
        head_len = layout.storage_offset_bytes
        tail_at = layout.storage_offset_bytes + layout.storage_nbytes

        def segments(into: memoryview) -> list[tuple[int, memoryview]]:
            # The framing before and after the storage record is read too, so the header
            # parsed above is verified by the same block checksums as the data.
            return [
                (info.offset, memoryview(bytearray(head_len))),
                (info.offset + start, into[:nbytes]),
                (info.offset + tail_at, memoryview(bytearray(info.length - tail_at))),
            ]

        return segments

    def _read_landed(
        self,
        f: VerifiedFile,
        segments: Callable[[memoryview], list[tuple[int, memoryview]]],
        target: torch.Tensor,
    ) -> None:
        """A destination the file cannot be read into (strided, or on a GPU): read and
        verify into a host landing buffer, then copy that to the destination."""
        landing = _landing_for(target)
        f.read_segments(segments(_writable_view(landing)))
        target.copy_(landing)

    def _read_staged(self, f: VerifiedFile, item: ReadItem, target: torch.Tensor) -> None:
        """Non-contiguous slice, transformed item, or a dtype/shape DCP converts: the
        item is read into memory (verified) and decoded by torch.load."""
        saved = torch.load(
            io.BytesIO(self._item_bytes(f, item)), map_location="cpu", weights_only=True
        )
        piece = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
        if target.size() != piece.size():
            raise CheckpointIncomplete(
                f"{item.storage_index}: saved slice has shape {tuple(piece.size())}, "
                f"destination {tuple(target.size())}"
            )
        target.copy_(piece)

    def _untransform(self, item: ReadItem, info: Any, raw: bytes | bytearray) -> bytes:
        transforms = dcp_filesystem._StorageReaderTransforms(self._extensions)
        stream = transforms.transform_load_stream(item, info.transform_descriptors, io.BytesIO(raw))
        data: bytes = stream.read(-1)
        return data
