"""A tiered `Storage` for Meta's torch_checkpointing 0.1.x: its `CheckpointManager`
saves into the memory tier of the node's tierckptd, and loads from it, a peer or the
persistent tier (`pip install 'tierckpt[torch-checkpointing]'`).

The one-line change (docs/torch-checkpointing.md)::

    from tierckpt.integrations.torch_checkpointing import StorageConfig

    manager = CheckpointManager(CheckpointManager.Config(
        storage_config=StorageConfig(namespace="run7"),
    ))
    manager.save("step-000100", {...})      # the checkpoint id is a tierckpt id
    manager.load("step-000100", into={...})

How its calls map to the daemon. Its writer puts every rank's files under a temporary
directory (``tmp_<id>``, `CheckpointWriterConfig.temp_dir_prefix`), waits at a barrier,
then rank 0 renames the directory onto ``<id>``; that rename is the commit:

- a file written under ``tmp_<id>/`` is a file of the save of ``<id>``, uncommitted
  (BeginCheckpoint, then `MemoryTierFile`: written in place in the memory tier with block
  checksums, budget reserved as it grows, CommitFile on close), invisible until the
  commit. Each rank records the names it wrote in the job's torch.distributed store
  (the one its barrier uses), so rank 0 knows every rank's files.
- ``rename(tmp_<id>, <id>)`` is CommitCheckpoint of all of them with format "files":
  atomically visible on every node, then replicated, drained to the persistent tier in the
  layout a local filesystem would have (so `LocalFileSystemStorageConfig` opens a
  downloaded copy), restored byte for byte; the daemon never decodes them.
- reads (`stream_read`, `read`, its mmap fill's concurrent ranged reads) are verified
  against the block checksums; a file this node lacks is fetched by the daemon from a
  peer or the persistent tier first (EnsureLocal), a corrupt copy repaired once. The
  streams of one file open at once (its mmap fill's ranges) share one open copy: one
  GetCheckpoint per fill, not one per range (`_OpenFiles`).
- ``exists``/``ls``/``getsize``/``isdir``/``glob`` answer from the catalog: committed
  checkpoints and their files, folders of ids, and a save in progress (``tmp_<id>``).
- ``rmdir(<id>)`` removes a committed checkpoint from every tier (``tierckpt rm``); on a
  temporary directory, or ``delete`` of one of its files, it aborts that save.

What cannot hold on a tiered store raises `UnsupportedOnTieredStore` (an OSError) naming
the call: a rename other than the temporary directory onto its checkpoint, a write
outside a temporary directory (``write_to_temp_dir=False``: nothing would commit it), a
file in a subdirectory of the checkpoint (tierckpt file names are one path component),
deleting a file of a committed checkpoint, and rmdir of a folder that is no checkpoint.

Copies per byte are those of its local backend: saving, one (the staged tensor bytes ->
the tmpfs page, `os.write`; torch.save's small framing writes are coalesced first), where
the local backend copies them into the page cache; loading through its mmap fill, one
(the tmpfs page -> its anonymous mmap, `os.preadv` into the target range, hashed there),
where the local backend reads the file into the same mmap. `read()` of a small file
(metadata.pkl, JSON items) takes one more (a bytearray, then bytes).
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch_checkpointing.checkpoint_writer import DEFAULT_TEMP_DIR_PREFIX
from torch_checkpointing.storage.base_storage import ReadArgs, Storage
from torch_checkpointing.storage.base_storage import StorageConfig as _StorageConfig

from tierckpt.daemon_client import DaemonClient
from tierckpt.endpoint import resolve_daemon_address
from tierckpt.errors import (
    CheckpointIncomplete,
    CheckpointNotFound,
    InvalidName,
    TierckptError,
)
from tierckpt.fsspec_files import ReadStream
from tierckpt.memory_files import VerifiedFile
from tierckpt.memory_tier_file import MemoryTierFile, SaveTarget
from tierckpt.names import (
    FORMAT_FILES,
    check_checkpoint_id,
    check_file_name,
    check_namespace,
)
from tierckpt.records import CheckpointInfo, FileEntry

__all__ = ["StorageConfig", "TieredStorage", "UnsupportedOnTieredStore"]

logger = logging.getLogger(__name__)

URL_PREFIX = "tierckpt:"  # Path("tierckpt://ns/id") spells itself "tierckpt:/ns/id"
_STORE_PREFIX = "tierckpt/torch_checkpointing"


class UnsupportedOnTieredStore(TierckptError, OSError):
    """A `Storage` call a tiered store cannot honour (see the module docstring)."""


@dataclass
class StorageConfig(_StorageConfig):
    """Creates a `TieredStorage`, as `LocalFileSystemStorageConfig` creates its local one.

    Attributes:
        namespace: the tierckpt namespace (one training job) relative checkpoint ids
            live in; "" when every id is a ``tierckpt://NAMESPACE/ID`` URL.
        daemon: the node's tierckptd (a socket path or host:port); None:
            ``$TIERCKPT_DAEMON``, else the default socket.
        durable: commit each checkpoint with the durable hint (drained to the persistent
            tier whatever ``[persistent] every`` says).
        temp_dir_prefix: the writer's `CheckpointWriterConfig.temp_dir_prefix`.
        store_timeout_s: how long a rank waits to reach the job's store.
    """

    namespace: str = ""
    daemon: str | None = None
    durable: bool = False
    temp_dir_prefix: str = DEFAULT_TEMP_DIR_PREFIX
    store_timeout_s: float = 600.0
    # (rank, world size, store coordinates) where the config was sent to another process
    # (the writer's background process has no process group): captured by __getstate__.
    _captured: tuple[int, int, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.namespace:
            check_namespace(self.namespace)
        if not self.temp_dir_prefix:
            raise InvalidName("temp_dir_prefix must not be empty: the rename is the commit")

    def coordinates(self) -> tuple[int, int, Any]:
        """This process's rank, the world size and the job store's coordinates (None for
        one rank): from the default process group, else as captured when this config
        crossed into this process."""
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            store = None
            if world > 1:
                from torch_checkpointing.barriers import _default_store_connection_info

                store = _default_store_connection_info()
            return dist.get_rank(), world, store
        return self._captured or (0, 1, None)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_captured": self.coordinates()}

    def create_storage(self) -> TieredStorage:
        return TieredStorage(self)


@dataclass(frozen=True)
class _Path:
    """A path as the storage sees it: the namespace and the segments under it."""

    namespace: str
    parts: tuple[str, ...]

    @property
    def joined(self) -> str:
        return "/".join(self.parts)

    def url(self) -> str:
        return f"tierckpt://{self.namespace}/{self.joined}".rstrip("/")


_FileKey = tuple[str, str, str]  # (namespace, checkpoint id, file name)


class _OpenFiles:
    """Committed files open for reading, shared by the streams reading them at once.

    Its mmap fill opens one stream per range (16 for a 1 GiB file at its default 64 MiB
    ranges), each of which would otherwise cost a GetCheckpoint and an open, issued at
    once by its workers and answered one after another by the daemon: on a loaded node
    that was tens of ms each, on the load's critical path. A stream of a file that is
    already open here reuses its descriptor and checksums (one open per file, single
    flight: concurrent first opens wait for one RPC), and the last one out closes it. The
    descriptor pins what was opened, so every range of one fill reads the same version
    of the file, verified against its own checksums.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the tables
        self._opening = threading.Lock()  # one first open at a time (single flight)
        self._open: dict[_FileKey, tuple[FileEntry, VerifiedFile]] = {}
        self._users: dict[int, int] = {}  # id(VerifiedFile) -> streams holding it

    def _take(self, key: _FileKey) -> tuple[FileEntry, VerifiedFile] | None:
        with self._lock:
            found = self._open.get(key)
            if found is not None:
                self._users[id(found[1])] += 1
            return found

    def acquire(
        self, key: _FileKey, opener: Callable[[], tuple[FileEntry, VerifiedFile]]
    ) -> tuple[FileEntry, VerifiedFile]:
        """(entry, the shared open file) of `key`; `opener()` opens it when none is."""
        found = self._take(key)
        if found is not None:
            return found
        with self._opening:
            found = self._take(key)
            if found is not None:
                return found
            entry, file = opener()
            with self._lock:
                self._open[key] = (entry, file)
                self._users[id(file)] = 1
            return entry, file

    def release(self, key: _FileKey, file: VerifiedFile, *, corrupt: bool = False) -> None:
        """A stream is done with `file`; `corrupt`: no later stream may take it (each
        reader repairs the local copy and reads its own). The last one out closes it."""
        with self._lock:
            left = self._users.get(id(file), 1) - 1
            if (corrupt or left == 0) and self._open.get(key, (None, None))[1] is file:
                del self._open[key]
            if left > 0:
                self._users[id(file)] = left
                return
            self._users.pop(id(file), None)
        file.close()


class _SharedReadStream(ReadStream):
    """A `ReadStream` over a file shared through `_OpenFiles` (a repaired copy, which it
    opens itself, stays its own)."""

    def __init__(
        self,
        client: DaemonClient,
        info_of: tuple[str, str],
        entry: FileEntry,
        opened: VerifiedFile,
        files: _OpenFiles,
    ) -> None:
        self._files = files
        self._shared: VerifiedFile | None = opened
        super().__init__(client, *info_of, entry, opened=opened)

    def _release(self, file: VerifiedFile, *, corrupt: bool = False) -> None:
        if file is self._shared:
            self._shared = None
            self._files.release(
                (self.namespace, self.checkpoint_id, self.name), file, corrupt=corrupt
            )
        else:
            file.close()


class TieredStorage(Storage):
    """torch_checkpointing's `Storage` over the node's tierckptd (module docstring)."""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.rank, self.world, self._store_info = config.coordinates()
        self._prefix = config.temp_dir_prefix
        self._clients: dict[int, DaemonClient] = {}
        self._store: Any = None
        self._lock = threading.Lock()
        self._written: dict[tuple[str, str], set[str]] = {}  # this process's, per save
        self._node = ""
        self._open_files = _OpenFiles()

    # --- plumbing ---------------------------------------------------------------------
    @property
    def client(self) -> DaemonClient:
        """One client per process (the storage may be used after a fork)."""
        pid = os.getpid()
        with self._lock:
            client = self._clients.get(pid)
            if client is None:
                address = resolve_daemon_address(self.config.daemon)
                client = self._clients[pid] = DaemonClient(address)
            return client

    def _job_store(self) -> Any:
        """A client of the job's torch.distributed store; None for one rank."""
        if self.world <= 1 or self._store_info is None:
            return None
        with self._lock:
            if self._store is None:
                timeout = timedelta(seconds=self.config.store_timeout_s)
                self._store = self._store_info.create_client_store(timeout=timeout)
            return self._store

    @staticmethod
    def _store_key(namespace: str, checkpoint_id: str) -> str:
        return f"{_STORE_PREFIX}/{namespace}/{checkpoint_id}"

    def _parse(self, path: Path | str) -> _Path:
        text = os.fspath(path)
        if text.startswith(URL_PREFIX):
            rest = text[len(URL_PREFIX) :].lstrip("/")
            namespace, _, under = rest.partition("/")
        elif text.startswith("/"):
            raise InvalidName(
                f"{text[:160]!r}: a tierckpt checkpoint is a checkpoint id (with "
                "StorageConfig(namespace=...)) or tierckpt://NAMESPACE/ID, not a local path"
            )
        elif not self.config.namespace:
            raise InvalidName(
                f"{text[:160]!r}: set StorageConfig(namespace=...) or use "
                "tierckpt://NAMESPACE/ID checkpoint ids"
            )
        else:
            namespace, under = self.config.namespace, text
        parts = tuple(p for p in under.split("/") if p not in ("", "."))
        if ".." in parts:
            raise InvalidName(f"{text[:160]!r}: '..' is not a path segment on a tiered store")
        return _Path(check_namespace(namespace), parts)

    def _temp_of(self, segment: str) -> str | None:
        """The checkpoint id segment a temporary directory segment stands for, if it is one."""
        if segment.startswith(self._prefix) and len(segment) > len(self._prefix):
            return segment[len(self._prefix) :]
        return None

    def _as_temp_dir(self, p: _Path) -> str | None:
        """The checkpoint id whose save `p` (``.../tmp_<id>``) is the temporary dir of."""
        if not p.parts:
            return None
        final = self._temp_of(p.parts[-1])
        if final is None:
            return None
        return check_checkpoint_id("/".join([*p.parts[:-1], final]))

    def _as_file(self, p: _Path) -> tuple[str, str, bool]:
        """(checkpoint id, file name, whether it is in a save's temporary directory)."""
        if len(p.parts) < 2:
            raise IsADirectoryError(f"{p.url()} is not a file of a checkpoint")
        directory = _Path(p.namespace, p.parts[:-1])
        if any(self._temp_of(segment) is not None for segment in directory.parts[:-1]):
            raise UnsupportedOnTieredStore(
                f"{p.url()}: a file in a subdirectory of a checkpoint; tierckpt file names "
                "are one path component ([A-Za-z0-9._-]{1,128}): use a flat LayoutInfo.file_path"
            )
        name = check_file_name(p.parts[-1])
        temp = self._as_temp_dir(directory)
        if temp is not None:
            return temp, name, True
        return check_checkpoint_id(directory.joined), name, False

    def _committed(self, namespace: str, checkpoint_id: str) -> CheckpointInfo | None:
        try:
            return self.client.get_checkpoint(namespace, check_checkpoint_id(checkpoint_id))
        except (InvalidName, CheckpointNotFound):
            return None

    def _entry_of(self, path: Path | str) -> tuple[CheckpointInfo, Any]:
        p = self._parse(path)
        checkpoint_id, name, temp = self._as_file(p)
        if temp:
            raise UnsupportedOnTieredStore(
                f"{p.url()}: a file of a save in progress is not readable before its commit "
                "(the rename of the temporary directory)"
            )
        info = self.client.get_checkpoint(p.namespace, checkpoint_id)
        try:
            return info, info.file(name)
        except KeyError:
            raise CheckpointNotFound(f"{p.url()}: no such file in the checkpoint") from None

    # --- writes -----------------------------------------------------------------------
    def stream_write(self, path: Path) -> io.IOBase:
        p = self._parse(path)
        checkpoint_id, name, temp = self._as_file(p)
        if not temp:
            raise UnsupportedOnTieredStore(
                f"{p.url()}: tierckpt takes writes only under a save's temporary directory "
                f"({self._prefix}<id>/<file>, one path component per file): its rename is "
                "the commit. Keep CheckpointWriterConfig(write_to_temp_dir=True) and a "
                "barrier (the defaults)"
            )
        target = SaveTarget(p.namespace, checkpoint_id, self.rank)
        client = self.client
        node = client.begin_checkpoint(p.namespace, checkpoint_id, self.rank)
        self._node = node or self._node
        return MemoryTierFile(client, target, name, grow=True, on_committed=self._file_committed)

    def _file_committed(self, file: MemoryTierFile) -> None:
        """Record the file for the commit: in this process, and in the job's store so
        that rank 0 commits every rank's files."""
        key = (file.target.namespace, file.target.checkpoint_id)
        with self._lock:
            self._written.setdefault(key, set()).add(file.file_name)
        store = self._job_store()
        if store is not None:
            store.append(self._store_key(*key), f"{self._node}\t{file.file_name}\n")

    def write(self, path: Path, data: Any) -> None:  # any buffer (its `Buffer`)
        with self.stream_write(path) as f:
            f.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """Folders are implicit (a checkpoint appears when it commits): checks names."""
        p = self._parse(path)
        if self._as_temp_dir(p) is None:
            for segment in p.parts:
                check_checkpoint_id(segment)

    # --- the commit -------------------------------------------------------------------
    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        src, dst = self._parse(src_path), self._parse(dst_path)
        checkpoint_id = self._as_temp_dir(src)
        if checkpoint_id is None or src.namespace != dst.namespace or dst.joined != checkpoint_id:
            raise UnsupportedOnTieredStore(
                f"cannot rename {src.url()} to {dst.url()}: files are committed in place on a "
                f"tiered store; only a save's temporary directory ({self._prefix}<id>) onto "
                "its checkpoint <id> (the writer's commit) is supported"
            )
        self._commit(dst.namespace, checkpoint_id)

    def _commit(self, namespace: str, checkpoint_id: str) -> None:
        with self._lock:
            names = set(self._written.pop((namespace, checkpoint_id), set()))
        holder_of = dict.fromkeys(names, self._node)
        store = self._job_store()
        key = self._store_key(namespace, checkpoint_id)
        if store is not None and store.check([key]):
            for line in bytes(store.get(key)).decode().splitlines():
                node, _, name = line.partition("\t")
                if name:
                    holder_of.setdefault(name, node)
        if not holder_of:
            raise CheckpointIncomplete(
                f"tierckpt://{namespace}/{checkpoint_id}: no file was written into its "
                "temporary directory, so there is nothing to commit"
            )
        # The daemon takes the node holding `.metadata`, else the first file by name, as
        # the checkpoint's coordinator (the node that commits and publishes it): that
        # must be this rank's. With its default layout rank 0 writes `<item>_0.pt` of
        # every item, which sorts first.
        anchor = ".metadata" if ".metadata" in holder_of else min(holder_of)
        if self._node and holder_of[anchor] not in ("", self._node):
            raise UnsupportedOnTieredStore(
                f"tierckpt://{namespace}/{checkpoint_id}: its first file by name, {anchor}, "
                f"was written on node {holder_of[anchor]}, not on the committing rank's node "
                f"{self._node}; tierckpt commits a checkpoint where that file is. Save every "
                "item on the rank that renames (rank 0), as the default layout does"
            )
        names = set(holder_of)
        holders = {n for n in holder_of.values() if n}
        info = self.client.commit_checkpoint(
            namespace,
            checkpoint_id,
            sorted(names),
            durable=self.config.durable,
            holder_nodes=sorted(holders),
            checkpoint_format=FORMAT_FILES,
        )
        if store is not None:
            store.delete_key(key)
        logger.info(
            "committed tierckpt://%s/%s: %d files, %d bytes",
            namespace,
            checkpoint_id,
            info.file_count,
            info.size_bytes,
        )

    # --- reads ------------------------------------------------------------------------
    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        """A verified, seekable stream of a committed file. No pre-read into a second
        buffer even when `read_args.pre_read_full_file` asks: the memory tier is already
        memory, and every read is verified where it lands."""
        p = self._parse(path)
        checkpoint_id, name, temp = self._as_file(p)
        key = (p.namespace, checkpoint_id, name)
        if temp:
            self._entry_of(path)  # raises: not readable before its commit

        def opener() -> tuple[FileEntry, VerifiedFile]:
            info, entry = self._entry_of(path)
            stream = ReadStream(self.client, info.namespace, info.checkpoint_id, entry)
            return entry, stream.detach()

        entry, file = self._open_files.acquire(key, opener)
        return _SharedReadStream(self.client, key[:2], entry, file, self._open_files)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        with self.stream_read(path, read_args) as f:
            return f.read()

    def getsize(self, path: Path) -> int:
        _, entry = self._entry_of(path)
        return int(entry.size)

    # --- listing ----------------------------------------------------------------------
    def _children(self, p: _Path) -> list[str]:
        """Names directly under folder `p` that committed ids go through."""
        prefix = f"{p.joined}/" if p.parts else ""
        found: set[str] = set()
        for c in self.client.list_checkpoints(p.namespace):
            if c.checkpoint_id.startswith(prefix) and c.checkpoint_id != p.joined:
                found.add(c.checkpoint_id[len(prefix) :].split("/", 1)[0])
        return sorted(found)

    def _writing(self, namespace: str, checkpoint_id: str) -> bool:
        with self._lock:
            if (namespace, checkpoint_id) in self._written:
                return True
        rows = self.client.list_checkpoints(namespace, include_uncommitted=True)
        return any(r.checkpoint_id == checkpoint_id and r.state == "WRITING" for r in rows)

    def ls(self, path: Path) -> list[str]:
        p = self._parse(path)
        names: list[str] = []
        info = self._committed(p.namespace, p.joined) if p.parts else None
        if info is not None:
            names = sorted(f.name for f in info.files)
        names += [n for n in self._children(p) if n not in names]
        if not names and not (p.parts and self._exists(p)):
            raise FileNotFoundError(f"{p.url()}: no such checkpoint or folder")
        return names

    def _exists(self, p: _Path) -> bool:
        temp = self._as_temp_dir(p)
        if temp is not None:
            return self._writing(p.namespace, temp)
        if not p.parts:
            return bool(self.client.list_checkpoints(p.namespace))
        if self._committed(p.namespace, p.joined) is not None or self._children(p):
            return True
        if len(p.parts) < 2:
            return False
        try:
            self._entry_of(str(p.url()))
        except (InvalidName, FileNotFoundError, UnsupportedOnTieredStore, IsADirectoryError):
            return False
        return True

    def exists(self, path: Path) -> bool:
        try:
            return self._exists(self._parse(path))
        except InvalidName:
            return False

    def isdir(self, path: Path) -> bool:
        p = self._parse(path)
        if self._as_temp_dir(p) is not None:
            return self._exists(p)
        if not p.parts:
            return True
        return self._committed(p.namespace, p.joined) is not None or bool(self._children(p))

    # --- removal ----------------------------------------------------------------------
    def delete(self, path: Path) -> None:
        p = self._parse(path)
        checkpoint_id, _, temp = self._as_file(p)
        if not temp:
            raise UnsupportedOnTieredStore(
                f"{p.url()}: the files of a committed checkpoint cannot be removed one by one; "
                "rmdir the checkpoint (every tier)"
            )
        self._abort(p.namespace, checkpoint_id)

    def rmdir(self, path: Path) -> None:
        p = self._parse(path)
        temp = self._as_temp_dir(p)
        if temp is not None:
            self._abort(p.namespace, temp)
            return
        if not p.parts or self._committed(p.namespace, p.joined) is None:
            raise UnsupportedOnTieredStore(
                f"{p.url()}: rmdir removes one committed checkpoint (from every tier); this "
                "is not one"
            )
        freed = self.client.delete_checkpoint(p.namespace, p.joined)
        logger.info("removed %s (%d bytes freed here)", p.url(), freed)

    def _abort(self, namespace: str, checkpoint_id: str) -> None:
        with self._lock:
            self._written.pop((namespace, checkpoint_id), None)
        try:
            self.client.abort_checkpoint(namespace, checkpoint_id)
        except CheckpointNotFound:
            pass  # nothing was written

    def remap_path(self, path: Path) -> str:
        return self._parse(path).url()
