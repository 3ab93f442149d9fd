"""TieredStorageWriter: DCP's FileSystemWriter, writing into the daemon's memory tier.

We keep FileSystemWriter's planning, bucketing, threads and serialization, so the files
are exactly the FileSystemWriter layout ("one format everywhere"), and swap only where
bytes go: `_MemoryTierFileSystem` opens each file as a `MemoryTierFile` (the save path
of `tierckpt://` too: asked of the daemon, written in place in shared memory with block
checksums, committed on close). The rank's budget is reserved from the plan before the
first file opens; `finish()` writes `.metadata` the same way and commits the checkpoint.

Copies per byte on `dcp.save`: one (tensor -> tmpfs page). `async_save` adds the
staging copy into the process's staging buffers (tierckpt.staging: reused by
every writer for the same namespace and layout), which is all the training loop waits for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tierckpt.completion import note_writer
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import CheckpointIncomplete, MemoryBudgetExceeded
from tierckpt.memory_tier_file import MemoryTierFile, SaveTarget, abort_quietly, reserve
from tierckpt.names import (
    METADATA_FILE,
    check_namespace,
    check_new_checkpoint_id,
    is_checkpoint_id,
)
from tierckpt.staging import stage_state_dict

__all__ = ["TieredStorageWriter"]

logger = logging.getLogger(__name__)

# torch.save framing per tensor item: zip headers, pickle, 64-byte alignment, directory.
_PER_ITEM_OVERHEAD = 4096


@dataclasses.dataclass(frozen=True)
class _RankNode:
    """What a rank's local plan carries to the coordinator: the node its daemon runs on,
    so that the commit asks those nodes for their files, not every node of the cluster."""

    node_id: str


class _MemoryTierFileSystem(FileSystemBase):
    """DCP file-system hooks over the daemon: paths are ``<checkpoint id>/<file name>``,
    each file a `MemoryTierFile` of this rank's part of the save (`target(checkpoint id)`,
    the writer's, rebuilt per save)."""

    def __init__(self, client: DaemonClient, target: Callable[[str], SaveTarget]) -> None:
        self.client = client
        # Weak: the writer holds this file system, so a strong bound method would make a
        # cycle that keeps the writer (and its daemon channel's socket) alive until the
        # cyclic GC runs; a long-lived rank making a writer per save would pile sockets up.
        self._target = weakref.WeakMethod(target)

    def target(self, checkpoint_id: str) -> SaveTarget:
        of = self._target()
        if of is None:
            raise RuntimeError("the TieredStorageWriter of this file system is gone")
        return of(checkpoint_id)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            raise ValueError(
                f"TieredStorageWriter only writes ({mode=}); read with TieredStorageReader"
            )
        checkpoint_id, file_name = str(path).rsplit("/", 1)  # the id may be a folder path
        # The plan's bytes were reserved in write_data: the file does not grow the budget.
        with MemoryTierFile(self.client, self.target(checkpoint_id), file_name, grow=False) as f:
            yield f

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{path}/{suffix}"

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        raise NotImplementedError("memory-tier files are committed, never renamed")

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """The daemon owns directories."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return TieredStorageWriter.validate_checkpoint_id(checkpoint_id)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return False

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        raise NotImplementedError("remove checkpoints with `tierckpt rm`")


class _MemoizedBytesPlanner:
    """Resolves each BYTE_IO item once, so its exact size can be reserved before writing."""

    def __init__(self, planner: SavePlanner) -> None:
        self._planner = planner
        self._bytes: dict[Any, Any] = {}

    def resolve_data(self, item: WriteItem) -> torch.Tensor | io.BytesIO:
        if item.type != WriteItemType.BYTE_IO:
            return self._planner.resolve_data(item)
        if item.index not in self._bytes:
            self._bytes[item.index] = self._planner.resolve_data(item)
        return cast(io.BytesIO, self._bytes[item.index])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def reservation(self, items: list[WriteItem]) -> int:
        """Bytes these items take in the file, rounded up by a per-item framing allowance."""
        total = 0
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                total += len(cast(io.BytesIO, self.resolve_data(item)).getbuffer())
            else:
                total += dcp_filesystem._item_size(item) + _PER_ITEM_OVERHEAD
        return total


class TieredStorageWriter(FileSystemWriter):
    """A DCP `StorageWriter` that saves into the local tierckptd's memory tier.

    Args:
        namespace: the training job (``llama3-70b-run7``); checkpoints of a job share it.
        daemon: the local daemon's address; default ``$TIERCKPT_DAEMON``, else the
            default unix socket.
        thread_count: files (and writer threads) per rank; 2 keeps both copy engines of
            a small host busy.
        durable: the "make this one durable" hint for each checkpoint this writer
            commits: the daemon drains it to the persistent tier whatever
            ``[persistent] every`` says, and keeps it in memory until it is there
            (NoPersistentTier at commit when the daemon has no persistent tier). A plain
            attribute: a reused writer may flip ``writer.durable`` between saves; what the
            coordinator's writer holds at ``finish`` counts.
        overwrite: saving an id already committed replaces it, as DCP's
            ``FileSystemWriter(overwrite=True)`` (its default) overwrites a folder, but
            atomically: the save is a new generation, and the old checkpoint stays listed
            and loadable (bit-exact, on every tier) until the new one commits, which
            retires it everywhere; an aborted or crashed re-save leaves it as it was.
            False keeps committed ids immutable: reusing one raises CheckpointExists
            before anything is written.

    The checkpoint id is DCP's ``checkpoint_id`` (``dcp.save(sd, checkpoint_id="step-000100",
    storage_writer=...)``).
    The writer pickles (``AsyncCheckpointerType.PROCESS``): it holds configuration only.
    """

    def __init__(
        self,
        namespace: str,
        *,
        daemon: str | None = None,
        thread_count: int = 2,
        durable: bool = False,
        overwrite: bool = True,
    ) -> None:
        super().__init__(
            path=check_namespace(namespace),
            single_file_per_rank=True,
            sync_files=False,  # tmpfs: fsync is meaningless; the commit RPC publishes
            thread_count=thread_count,
            cache_staged_state_dict=True,
            overwrite=overwrite,
        )
        self.namespace = namespace
        self.durable = durable
        # The save in progress, rebuilt per save: its id, this rank, this rank's daemon,
        # and (on the coordinator) every rank's daemon, for the commit.
        self._checkpoint_id: str | None = None
        self._rank = 0
        self._node_id = ""
        self._holder_nodes: tuple[str, ...] = ()
        self.client = DaemonClient(daemon)
        note_writer(namespace, self.client.address)  # where waits on its futures ask
        self.fs = _MemoryTierFileSystem(self.client, self._target_of)  # type: ignore[assignment]

    # --- identity ----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._checkpoint_id = check_new_checkpoint_id(str(checkpoint_id))
            self.path = self._checkpoint_id
        self._holder_nodes = ()
        self.save_id = dcp_filesystem._generate_uuid()

    @property
    def checkpoint_id(self) -> str | None:  # type: ignore[override]
        """The id of the save in progress; None until DCP passes ``checkpoint_id``."""
        return self._checkpoint_id

    def _require_id(self) -> str:
        if self._checkpoint_id is None:
            raise ValueError(
                "TieredStorageWriter needs a checkpoint id: pass checkpoint_id='step-000100' "
                "to dcp.save / dcp.async_save"
            )
        return self._checkpoint_id

    def _target(self) -> SaveTarget:
        """This rank's part of the save in progress."""
        return SaveTarget(self.namespace, self._require_id(), self._rank)

    def _target_of(self, checkpoint_id: str) -> SaveTarget:
        """This rank's part of the save of `checkpoint_id` (the file system's paths name it)."""
        return SaveTarget(self.namespace, checkpoint_id, self._rank)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_checkpoint_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        """Names the save as ``tierckpt://NAMESPACE/ID`` (a bare id names no namespace): the
        `Metadata` a save returns, an async_save future's result included, then says which
        checkpoint to wait on (`tierckpt.wait_for`), as DCP's fsspec writer's URL does."""
        checkpoint_id = self._checkpoint_id
        named = f"tierckpt://{self.namespace}/{checkpoint_id}" if checkpoint_id else None
        return StorageMeta(checkpoint_id=named, save_id=self.save_id)

    # --- DCP protocol -----------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise ValueError(
                "TieredStorageWriter needs use_collectives=True: rank-local metadata cannot be "
                "resharded and has no single commit point"
            )
        rank = self.rank
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._rank = rank
        # Fails fast (before planning) on a reused id (overwrite=False) or an unreachable
        # daemon.
        self._node_id = self.client.begin_checkpoint(
            self.namespace, self._require_id(), rank, overwrite=self.overwrite
        )
        note_writer(self.namespace, self.client.address, self._require_id())

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # FileSystemWriter's version checks a directory; the daemon already did.
        return dataclasses.replace(plan, storage_data=_RankNode(self._node_id))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Keep the ranks' nodes for the commit, then name the files as FileSystemWriter
        does (its prefixes replace what the local plans carried)."""
        nodes = {p.storage_data.node_id for p in plans if isinstance(p.storage_data, _RankNode)}
        self._holder_nodes = tuple(sorted(n for n in nodes if n))
        plans = [
            dataclasses.replace(p, storage_data=None)
            if isinstance(p.storage_data, _RankNode)
            else p
            for p in plans
        ]
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        memo = _MemoizedBytesPlanner(planner)
        needed = memo.reservation(plan.items) + self.thread_count * _PER_ITEM_OVERHEAD
        # Before any byte is written: RESOURCE_EXHAUSTED here leaves memory untouched.
        self._reserve(needed)
        rank = self._rank

        def all_written(done: Future[list[WriteResult]]) -> list[WriteResult]:
            # torch's FileSystemWriter runs thread_count - 1 extra writer threads and drops
            # their exceptions: the future then resolves without their items, and a
            # .metadata without them would commit a checkpoint that cannot load.
            results = done.value()
            missing = len({i.index for i in plan.items} - {r.index for r in results})
            if missing:
                raise CheckpointIncomplete(
                    f"save of {self.namespace}/{self._require_id()} on rank {rank}: {missing} "
                    f"of {len(plan.items)} items were not written (a writer thread failed; "
                    "its error is in this process's log); the checkpoint is not committed"
                )
            return results

        return super().write_data(plan, cast(SavePlanner, memo)).then(all_written)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        version = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", None)
        if version is not None:
            metadata.version = version
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        data = pickle.dumps(metadata)
        # The daemon refuses a file larger than the rank's reservation: reserve its size.
        self._reserve(len(data))
        with self.fs.create_stream(
            self.fs.concat_path(self._require_id(), METADATA_FILE), "wb"
        ) as stream:
            stream.write(data)
        required = {info.relative_path for info in metadata.storage_data.values()} | {METADATA_FILE}
        info = self.client.commit_checkpoint(
            self.namespace,
            self._require_id(),
            required,
            durable=self.durable,
            holder_nodes=self._holder_nodes,
        )
        logger.info(
            "committed %s/%s: %d files, %d bytes",
            self.namespace,
            self._require_id(),
            info.file_count,
            info.size_bytes,
        )

    def _reserve(self, nbytes: int) -> None:
        """Reserve the rank's next `nbytes`; when they do not fit, abort the save so every
        rank's reservation goes now, not at the daemon's clean-up."""
        try:
            reserve(self.client, self._target(), nbytes)
        except MemoryBudgetExceeded:
            abort_quietly(self.client, self._target())
            raise

    # --- async staging ----------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy the state into the process's staging buffers (one copy; see tierckpt.staging).

        The buffers belong to the process, keyed by namespace and state-dict layout, so a
        new writer per save still copies into warm pages. They start as private memory
        (the PROCESS executor's first hand-off moves them into shared memory once; then it
        pickles handles), and are pinned shared memory when the state is on a CUDA device.
        A stage never overwrites buffers an unfinished save still holds: it takes another set.
        """
        self.per_thread_copy_ahead = 0  # the staged state is on the host already
        return stage_state_dict(self.namespace, state_dict)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["state_dict_cache"] = None  # the staged tensors travel as the request, not with us
        del state["fs"]  # holds a weak reference to us: rebuilt on arrival
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.fs = _MemoryTierFileSystem(self.client, self._target_of)  # type: ignore[assignment]
