"""``tierckpt://NAMESPACE/CHECKPOINT_ID/FILE``: the local daemon as an fsspec filesystem.

Why: frameworks (torchtitan, Lightning, NeMo Automodel) hand DCP a ``checkpoint_id``
string and let DCP pick the storage; for a URL DCP picks its fsspec writer and reader,
and fsspec finds this class through the ``fsspec.specs`` entry point in every process
(DCP's PROCESS async child included). So ``dcp.save(sd, checkpoint_id=
"tierckpt://run7/step-000100")`` and ``dcp.load`` reach the memory tier with no tierckpt
import in the training script. `TieredStorageWriter`/`Reader` stay the fast path (budget
reserved from the plan, several writer threads, reads straight into the tensors).

How stock DCP's calls map to the daemon (torch 2.6-2.13):

- ``makedirs`` checks names only; ``_open(..., "wb")`` of a file begins the save
  (BeginCheckpoint), reserves budget as the stream grows and commits the file on close
  (`MemoryTierFile`, the save path TieredStorageWriter uses too).
- A save into a committed id replaces it, as a local folder is overwritten with DCP's
  default ``overwrite=True``, but atomically: the save is a new generation, and the old
  checkpoint stays listed and loadable until the new one commits, which retires it on
  every tier; an aborted or crashed re-save leaves it as it was. ``FsspecWriter(...,
  overwrite=False)`` keeps committed ids immutable: DCP sees ``.metadata`` exist and
  raises before writing a byte.
- ``.metadata.tmp`` is written as the checkpoint's ``.metadata``; ``mv(.metadata.tmp,
  .metadata)`` is the commit (CommitCheckpoint of every file the metadata names).
  Writing ``.metadata`` directly commits on close (writers that skip the rename).
- ``_open(..., "rb")`` reads a committed file verified; a file this node lacks is made
  local by the daemon from a peer or the persistent tier first. ``.metadata`` is checked
  with the allow-list decoder before DCP unpickles it.
- ``ls``/``info``/``exists``: a namespace lists its committed checkpoints (oldest commit
  first) as directories (with ``state``, ``tiers`` and ``levels``: the tiers it reached,
  `tierckpt.completion.TierState.levels`), a checkpoint its files; a save in progress is
  invisible until its commit, so "isfile(step/.metadata)" means committed (and not LOST:
  a checkpoint with a file on no tier is listed with its state, but `info`/`isfile` of
  its files answer not found). ``rm(ckpt, recursive=True)`` is ``tierckpt rm``; ``rm``
  of a file of a save in progress (DCP's error cleanup) aborts that save.
- ``latest`` as the checkpoint id reads the newest committed checkpoint (never one marked
  bad), resolved when ``.metadata`` is opened (so a load reads one checkpoint); it cannot
  be written. ``latest-verified`` reads the newest one marked verified (`tierckpt.mark`).

Folders work as local ones do: a checkpoint id may be a folder path (``tierckpt://team/
run1/step-10``; `tierckpt.names.check_checkpoint_id`), the file is always the last part
of a path opened, and for ``ls``/``info``/``rm`` the namespace's committed ids say what a
path is: a checkpoint, a folder holding checkpoints deeper (a directory: ``ls
tierckpt://team/run1`` shows ``team/run1/step-10``), or a file. ``rm(folder,
recursive=True)`` removes every checkpoint in it; ``makedirs`` only checks names.

Options come from the environment, because DCP rebuilds the filesystem from the URL
alone: the daemon is ``$TIERCKPT_DAEMON`` (or ``FSSPEC_TIERCKPT_DAEMON``), else the
default socket.
"""

from __future__ import annotations

import io
import logging
import os
import re
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fsspec.spec import AbstractFileSystem

from tierckpt.completion import TierState
from tierckpt.daemon_client import DaemonClient
from tierckpt.dcp_metadata import load_metadata
from tierckpt.endpoint import resolve_daemon_address
from tierckpt.errors import (
    CheckpointExists,
    CheckpointIncomplete,
    InvalidName,
    TierckptError,
    TierUnavailable,
)
from tierckpt.fsspec_files import ReadStream
from tierckpt.memory_files import VerifiedFile
from tierckpt.memory_tier_file import MemoryTierFile, SaveTarget
from tierckpt.names import (
    LATEST,
    LATEST_VERIFIED,
    MAX_ID,
    MAX_ID_SEGMENTS,
    METADATA_FILE,
    check_checkpoint_id,
    check_file_name,
    check_namespace,
    is_checkpoint_id,
)
from tierckpt.records import CheckpointInfo

__all__ = ["LATEST", "PROTOCOL", "TierPath", "TierckptFileSystem", "parse_path"]

logger = logging.getLogger(__name__)

PROTOCOL = "tierckpt"
METADATA_TMP = METADATA_FILE + ".tmp"
_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")


@dataclass(frozen=True)
class TierPath:
    """A parsed ``tierckpt://NAMESPACE/PATH`` path. `path` is what lies under the
    namespace ("" when the path stops at it): a checkpoint id (``run1/step-10``), a folder
    of ids (``run1``) or a checkpoint's file (``run1/step-10/.metadata``); which one is
    settled by what is committed (`TierckptFileSystem._resolve`), or by the call (a file is
    opened, a checkpoint is removed)."""

    namespace: str = ""
    path: str = ""

    @property
    def depth(self) -> int:
        """0 the root, 1 a namespace, 2 and more a path under it (one per segment)."""
        return (1 + self.path.count("/") + 1 if self.path else 1) if self.namespace else 0

    @property
    def name(self) -> str:
        """The fsspec name (no protocol)."""
        return f"{self.namespace}/{self.path}" if self.path else self.namespace

    @property
    def checkpoint_id(self) -> str:
        """`path` as a checkpoint id (InvalidName if it cannot be one)."""
        return check_checkpoint_id(self.path)

    def as_file(self) -> tuple[str, str]:
        """`path` as (checkpoint id, file name): the file is its last segment."""
        checkpoint_id, _, file_name = self.path.rpartition("/")
        if not checkpoint_id:
            raise IsADirectoryError(
                f"tierckpt://{self.name} is not a file: files live in a checkpoint "
                "(tierckpt://NAMESPACE/CHECKPOINT_ID/FILE)"
            )
        return check_checkpoint_id(checkpoint_id), check_file_name(file_name)


def parse_path(path: str) -> TierPath:
    """``[tierckpt://]NAMESPACE[/PATH]``: the namespace validated, and every segment of
    PATH a valid checkpoint-id segment (InvalidName), at most one more than an id holds
    (the file). Whether PATH is a checkpoint, a folder or a file is the caller's to say."""
    stripped = TierckptFileSystem._strip_protocol(path)
    if not stripped:
        return TierPath()
    namespace, _, rest = stripped.partition("/")
    segments = rest.split("/") if rest else []
    if len(segments) > MAX_ID_SEGMENTS + 1 or len(rest) > MAX_ID + 1 + 128:
        raise InvalidName(
            f"tierckpt:// path {stripped[:160]!r} is too deep or long: a checkpoint id is at "
            f"most {MAX_ID_SEGMENTS} folders and {MAX_ID} characters"
        )
    for segment in segments:
        if segment.startswith(".") and segment not in (".", ".."):
            check_file_name(segment)  # `.metadata`, `.metadata.tmp`: a file, never a folder
        else:
            check_checkpoint_id(segment)
    return TierPath(check_namespace(namespace), rest)


# One DaemonClient (one channel) per process and address; the filesystem objects are
# cheap and rebuilt often (DCP's validation instantiates one per save).
_CLIENTS: dict[tuple[int, str], DaemonClient] = {}
# (address, namespace, id) -> files the `.metadata` this process wrote names, until the
# rename commits them.
_PENDING: dict[tuple[str, str, str], frozenset[str]] = {}
# (address, namespace, `latest` or `latest-verified`) -> the checkpoint it resolved to when
# its .metadata was read.
_LATEST: dict[tuple[str, str, str], str] = {}
_STATE_LOCK = threading.Lock()


def _rank_for(file_name: str) -> int:
    """The reservation key of a file: DCP's rank in a data file's name, else this
    process's rank (the coordinator writes .metadata)."""
    match = _DATA_FILE.fullmatch(file_name)
    if match:
        return int(match.group(1))
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _timestamp(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, tz=UTC)


class TierckptFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """fsspec filesystem over the local tierckptd; see the module docstring."""

    protocol = (PROTOCOL,)
    root_marker = ""

    def __init__(self, daemon: str | None = None, **storage_options: Any) -> None:
        super().__init__(**storage_options)
        self._daemon = daemon  # resolved per call: $TIERCKPT_DAEMON may change

    # --- plumbing ---------------------------------------------------------------------
    @property
    def client(self) -> DaemonClient:
        address = resolve_daemon_address(self._daemon)
        key = (os.getpid(), address)
        with _STATE_LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                client = _CLIENTS[key] = DaemonClient(address)
            return client

    def _checkpoint(
        self, namespace: str, checkpoint_id: str, latest: str = "newest"
    ) -> CheckpointInfo:
        """The committed checkpoint named. For `latest`: "newest" resolves it now,
        "bind" resolves it and remembers the answer for this load (DCP reads .metadata
        first), "bound" reuses that answer (the data files of the same load)."""
        client = self.client
        if checkpoint_id not in (LATEST, LATEST_VERIFIED):
            return client.get_checkpoint(namespace, checkpoint_id)
        key = (client.address, namespace, checkpoint_id)
        if latest == "bound":
            with _STATE_LOCK:
                bound = _LATEST.get(key)
            if bound is not None:
                return client.get_checkpoint(namespace, bound)
        info = client.get_checkpoint(namespace, None, verified=checkpoint_id == LATEST_VERIFIED)
        if latest == "bind":
            with _STATE_LOCK:
                _LATEST[key] = info.checkpoint_id
        return info

    def _committed(self, namespace: str, path: str) -> CheckpointInfo | None:
        """The checkpoint `path` names, if it is a valid id with one; else None."""
        try:
            return self._checkpoint(namespace, check_checkpoint_id(path))
        except (InvalidName, FileNotFoundError):
            return None

    @staticmethod
    def _writable(checkpoint_id: str, name: str, what: str) -> None:
        if checkpoint_id in (LATEST, LATEST_VERIFIED):
            raise InvalidName(
                f"{what} tierckpt://{name}: {checkpoint_id!r} names the newest committed "
                "(or verified) checkpoint "
                "in tierckpt:// URLs; save under a new id"
            )

    # --- open -------------------------------------------------------------------------
    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> io.IOBase:
        p = parse_path(path)
        if p.depth < 3:
            raise IsADirectoryError(f"tierckpt://{p.name} is not a file")
        checkpoint_id, file_name = p.as_file()
        if mode == "rb":
            return self._open_read(p, checkpoint_id, file_name)
        if mode == "wb":
            return self._open_write(p, checkpoint_id, file_name, autocommit)
        raise ValueError(f"tierckpt:// files are written once ('wb') and read ('rb'), not {mode!r}")

    def _open_write(
        self, p: TierPath, checkpoint_id: str, name: str, autocommit: bool
    ) -> MemoryTierFile:
        self._writable(checkpoint_id, p.name, "cannot write")
        on_committed = None
        if name == METADATA_TMP:
            name, on_committed = METADATA_FILE, self._metadata_written
        elif name == METADATA_FILE:
            on_committed = self._metadata_written_final
        target = SaveTarget(p.namespace, checkpoint_id, _rank_for(name))
        # No set-up hook on this route: each file begins (or joins) the save; DCP checked
        # its own `overwrite` already (an existing `.metadata`), so this one replaces.
        self.client.begin_checkpoint(
            target.namespace, target.checkpoint_id, target.rank, overwrite=True
        )
        return MemoryTierFile(
            self.client,
            target,
            name,
            grow=True,
            autocommit=autocommit,
            on_committed=on_committed,
        )

    def _metadata_written(self, file: MemoryTierFile) -> None:
        """Remember the files this `.metadata` names (checked with the allow-list decoder:
        what is committed is what a safe reader accepts); the rename commits them."""
        t = file.target
        assert file.checksums is not None
        with VerifiedFile(file.path, file.size, file.checksums, what=file.what) as f:
            metadata = load_metadata(f.read(0, f.size), what=file.what)
        storage = metadata.storage_data or {}
        required = frozenset({info.relative_path for info in storage.values()} | {METADATA_FILE})
        with _STATE_LOCK:
            _PENDING[(file.client.address, t.namespace, t.checkpoint_id)] = required

    def _metadata_written_final(self, file: MemoryTierFile) -> None:
        self._metadata_written(file)
        self._commit(file.target.namespace, file.target.checkpoint_id)

    def _commit(self, namespace: str, checkpoint_id: str) -> None:
        client = self.client
        with _STATE_LOCK:
            required = _PENDING.pop((client.address, namespace, checkpoint_id), None)
        if required is None:
            raise CheckpointIncomplete(
                f"tierckpt://{namespace}/{checkpoint_id}: no {METADATA_TMP} was written by this "
                "process, so there is nothing to commit"
            )
        info = client.commit_checkpoint(namespace, checkpoint_id, required)
        logger.info(
            "committed tierckpt://%s/%s: %d files, %d bytes",
            namespace,
            checkpoint_id,
            info.file_count,
            info.size_bytes,
        )

    def _open_read(self, p: TierPath, checkpoint_id: str, file_name: str) -> io.IOBase:
        latest = "bind" if file_name == METADATA_FILE else "bound"
        info = self._checkpoint(p.namespace, checkpoint_id, latest)
        try:
            entry = info.file(file_name)
        except KeyError:
            raise FileNotFoundError(f"tierckpt://{p.name}: no such file") from None
        stream = ReadStream(self.client, info.namespace, info.checkpoint_id, entry)
        if file_name != METADATA_FILE:
            return stream
        with stream:
            raw = stream.readall()
        # DCP unpickles what we return: only bytes the allow-list decoder accepts.
        load_metadata(raw, what=stream.what)
        return io.BytesIO(raw)

    # --- commit, remove -----------------------------------------------------------------
    def mv(self, path1: str, path2: str, recursive: bool = False, **kwargs: Any) -> None:
        """Only DCP's ``.metadata.tmp -> .metadata`` rename, which commits the checkpoint."""
        p1, p2 = parse_path(path1), parse_path(path2)
        if p1.depth >= 3 and p2.depth >= 3 and p1.namespace == p2.namespace:
            (id1, f1), (id2, f2) = p1.as_file(), p2.as_file()
            if id1 == id2 and (f1, f2) == (METADATA_TMP, METADATA_FILE):
                self._writable(id2, p2.name, "cannot commit")
                self._commit(p2.namespace, id2)
                return
        raise OSError(
            f"tierckpt:// cannot rename {p1.name!r} to {p2.name!r}: files are committed in "
            f"place; only DCP's {METADATA_TMP} -> {METADATA_FILE} rename (the commit) is supported"
        )

    def rm(
        self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None
    ) -> None:
        for one in [path] if isinstance(path, str) else path:
            self._rm_one(parse_path(one), recursive)

    def rm_file(self, path: str) -> None:
        self._rm_one(parse_path(path), False)

    def _rm(self, path: str) -> None:
        self._rm_one(parse_path(path), False)

    def _rm_one(self, p: TierPath, recursive: bool) -> None:
        """A checkpoint (with `recursive`), every checkpoint in a folder (the same), or a
        file of a save in progress (DCP's clean-up of a failed write: the save aborts)."""
        client = self.client
        if p.depth < 2:
            raise PermissionError(
                f"tierckpt://{p.name}: remove checkpoints or folders one by one "
                "(rm('tierckpt://NAMESPACE/FOLDER', recursive=True))"
            )
        self._writable(p.path, p.name, "cannot remove")
        under = [
            c.checkpoint_id
            for c in client.list_checkpoints(p.namespace)
            if c.checkpoint_id == p.path or c.checkpoint_id.startswith(f"{p.path}/")
        ]
        if under:
            if not recursive:
                raise IsADirectoryError(
                    f"tierckpt://{p.name} is a checkpoint or folder: rm(..., recursive=True) "
                    "deletes it"
                )
            for checkpoint_id in under:
                freed = client.delete_checkpoint(p.namespace, checkpoint_id)
                logger.info(
                    "removed tierckpt://%s/%s (%d bytes freed)", p.namespace, checkpoint_id, freed
                )
            return
        if recursive and is_checkpoint_id(p.path):  # not listed: a save in progress, or none
            freed = client.delete_checkpoint(p.namespace, p.path)
            logger.info("removed tierckpt://%s (%d bytes freed)", p.name, freed)
            return
        if p.depth == 2:
            raise IsADirectoryError(
                f"tierckpt://{p.name} names a checkpoint: rm(..., recursive=True) deletes it"
            )
        checkpoint_id, name = p.as_file()
        with _STATE_LOCK:
            written = (client.address, p.namespace, checkpoint_id) in _PENDING
        if name == METADATA_FILE and written:
            # DCP's overwrite removes the old `.metadata` before its rename: the commit
            # that rename makes replaces the old generation atomically, so nothing goes now.
            return
        try:
            client.abort_checkpoint(p.namespace, checkpoint_id)
        except CheckpointIncomplete:  # committed: its files are immutable
            raise PermissionError(
                f"tierckpt://{p.name} belongs to a committed checkpoint; its files cannot be "
                "removed one by one: rm the checkpoint with recursive=True"
            ) from None
        with _STATE_LOCK:
            _PENDING.pop((client.address, p.namespace, checkpoint_id), None)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Folders are implicit: a checkpoint appears when it commits, a folder when a
        checkpoint in it does. Checks the names, and `exist_ok=False` on a committed
        checkpoint raises FileExistsError."""
        p = parse_path(path)
        if p.depth >= 2 and not exist_ok and self._committed(p.namespace, p.path) is not None:
            raise CheckpointExists(f"tierckpt://{p.name} is already committed")

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.makedirs(path, exist_ok=True)

    def rmdir(self, path: str) -> None:
        self._rm_one(parse_path(path), True)

    # --- listing ----------------------------------------------------------------------
    @staticmethod
    def _checkpoint_entry(name: str, info: CheckpointInfo) -> dict[str, Any]:
        return {
            "name": name,
            "type": "directory",
            "size": info.size_bytes,
            "checkpoint_id": info.checkpoint_id,
            "state": info.state,
            "sequence": info.sequence,
            "created": info.created_unix,
            "mtime": info.committed_unix,
            "files": info.file_count,
            "tiers": list(info.tiers),
            "pinned": info.pinned,
            # the tiers it reached, as `tierckpt info` and `tierckpt.tier_state` say
            "levels": TierState.of(info).levels(),
        }

    def _children(
        self, namespace: str, folder: str, rows: list[CheckpointInfo] | None = None
    ) -> list[dict[str, Any]]:
        """What a listing of `folder` ("" the namespace) shows of the checkpoints in it,
        oldest commit first: each checkpoint directly in it, and each folder holding
        checkpoints deeper (once, as a directory). `rows`: the namespace's listing, if
        already asked for."""
        prefix = f"{folder}/" if folder else ""
        entries: dict[str, dict[str, Any]] = {}
        for c in self.client.list_checkpoints(namespace) if rows is None else rows:
            if not c.checkpoint_id.startswith(prefix) or c.checkpoint_id == folder:
                continue
            child = c.checkpoint_id[len(prefix) :].split("/", 1)[0]
            name = f"{namespace}/{prefix}{child}"
            if prefix + child == c.checkpoint_id:
                entries[name] = self._checkpoint_entry(name, c)
            else:
                entries.setdefault(name, {"name": name, "type": "directory", "size": 0})
        return list(entries.values())

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        p = parse_path(path)
        entries: list[dict[str, Any]]
        if p.depth == 0:
            names = self.client.status().namespaces
            entries = [{"name": ns, "type": "directory", "size": 0} for ns in names]
        else:
            outages: list[TierUnavailable] = []
            info = self._lookup(p.namespace, p.path, outages) if p.path else None
            entries = (
                [
                    {"name": f"{p.name}/{f.name}", "type": "file", "size": f.size, "rank": f.rank}
                    for f in sorted(info.files, key=lambda f: f.name)
                ]
                if info is not None
                else []
            )
            if p.path not in (LATEST, LATEST_VERIFIED):
                entries += self._children(p.namespace, p.path)
            if not entries and p.path:
                if outages:
                    raise outages[0]
                entries = [self.info(path)]  # a file, or FileNotFoundError
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """A file of a committed checkpoint, a checkpoint, or a folder holding some, in
        that order. A checkpoint's daemon lookup may ask the persistent tier (an id the
        listing lacks); its outage is raised only when nothing else answers, and a path
        under a committed checkpoint (``step-20/model.safetensors.index.json``) is
        looked up in the listing only, so a framework's probes stay answers."""
        p = parse_path(path)
        if p.depth == 0:
            return {"name": "", "type": "directory", "size": 0}
        if p.depth == 1:
            found = self.client.list_checkpoints(p.namespace)
            if not found:
                raise FileNotFoundError(f"tierckpt://{p.name} has no committed checkpoints")
            return {"name": p.name, "type": "directory", "size": 0, "checkpoints": len(found)}
        outages: list[TierUnavailable] = []
        in_checkpoint = False
        if p.depth >= 3:
            in_checkpoint, entry = self._file_info(p, outages)
            if entry is not None:
                return entry
        checkpoint = None if in_checkpoint else self._lookup(p.namespace, p.path, outages)
        if checkpoint is not None:
            return self._checkpoint_entry(p.name, checkpoint)
        rows = self.client.list_checkpoints(p.namespace)
        listed = next((c for c in rows if c.checkpoint_id == p.path), None)
        if listed is not None:
            return self._checkpoint_entry(p.name, listed)
        if p.path not in (LATEST, LATEST_VERIFIED) and self._children(p.namespace, p.path, rows):
            return {"name": p.name, "type": "directory", "size": 0}
        if outages:
            raise outages[0]
        raise FileNotFoundError(f"tierckpt://{p.name}: no such checkpoint, folder or file")

    def _lookup(
        self, namespace: str, path: str, outages: list[TierUnavailable]
    ) -> CheckpointInfo | None:
        """The checkpoint `path` names, None if none (or if a tier behind the daemon is
        down: the outage is added to `outages`)."""
        try:
            return self._checkpoint(namespace, check_checkpoint_id(path))
        except (InvalidName, FileNotFoundError):
            return None
        except TierUnavailable as e:
            outages.append(e)
            return None

    def _file_info(
        self, p: TierPath, outages: list[TierUnavailable]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether `p`'s parent is a committed checkpoint, and `p` as its file (None if
        it is not one)."""
        try:
            checkpoint_id, file_name = p.as_file()
        except InvalidName:
            return False, None
        info = self._lookup(p.namespace, checkpoint_id, outages)
        if info is None:
            return False, None
        if info.state == "LOST":
            # "isfile(step/.metadata)" is how frameworks find a loadable step: a checkpoint
            # with a file on no tier has none (it stays listed, with its state, for rm).
            raise FileNotFoundError(
                f"tierckpt://{p.name}: checkpoint {info.checkpoint_id} is LOST (a file has no "
                "copy left on any tier); load an older one"
            )
        try:
            f = info.file(file_name)
        except KeyError:
            return True, None
        return True, {"name": p.name, "type": "file", "size": f.size, "rank": f.rank}

    def exists(self, path: str, **kwargs: Any) -> bool:
        """Whether `path` is committed. A daemon that cannot be reached raises (it is not
        an answer), unlike fsspec's default that turns every error into False."""
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    def isdir(self, path: str) -> bool:
        try:
            return bool(self.info(path)["type"] == "directory")
        except FileNotFoundError:
            return False

    def isfile(self, path: str) -> bool:
        try:
            return bool(self.info(path)["type"] == "file")
        except FileNotFoundError:
            return False

    def created(self, path: str) -> datetime:
        return _timestamp(float(self._checkpoint_of(path).created_unix))

    def modified(self, path: str) -> datetime:
        return _timestamp(float(self._checkpoint_of(path).committed_unix))

    def _checkpoint_of(self, path: str) -> CheckpointInfo:
        p = parse_path(path)
        if p.depth < 2:
            raise FileNotFoundError(f"tierckpt://{p.name} is not a checkpoint")
        return self._checkpoint(p.namespace, p.checkpoint_id)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        raise TierckptError("tierckpt:// cannot copy files: save the state under a new id")
