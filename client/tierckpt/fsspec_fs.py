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
  (BeginCheckpoint: a committed id raises CheckpointExists, a FileExistsError), reserves
  budget as the stream grows and commits the file on close (`MemoryTierFile`, the save
  path TieredStorageWriter uses too).
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
)
from tierckpt.fsspec_files import ReadStream
from tierckpt.memory_files import VerifiedFile
from tierckpt.memory_tier_file import MemoryTierFile, SaveTarget
from tierckpt.names import (
    LATEST,
    LATEST_VERIFIED,
    METADATA_FILE,
    check_checkpoint_id,
    check_file_name,
    check_namespace,
)
from tierckpt.records import CheckpointInfo

__all__ = ["LATEST", "PROTOCOL", "TierPath", "TierckptFileSystem", "parse_path"]

logger = logging.getLogger(__name__)

PROTOCOL = "tierckpt"
METADATA_TMP = METADATA_FILE + ".tmp"
_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")


@dataclass(frozen=True)
class TierPath:
    """A parsed ``tierckpt://`` path; trailing parts are "" when the path stops earlier."""

    namespace: str = ""
    checkpoint_id: str = ""
    file_name: str = ""

    @property
    def depth(self) -> int:
        return sum(bool(p) for p in (self.namespace, self.checkpoint_id, self.file_name))

    @property
    def name(self) -> str:
        """The fsspec name (no protocol)."""
        return "/".join(p for p in (self.namespace, self.checkpoint_id, self.file_name) if p)


def parse_path(path: str) -> TierPath:
    """``[tierckpt://]NAMESPACE[/CHECKPOINT_ID[/FILE]]``, every part validated (InvalidName).

    Folders nested deeper (``tierckpt://run7/ckpts/step-1``) are refused rather than
    folded into an id, so a listing always shows what a save wrote.
    """
    stripped = TierckptFileSystem._strip_protocol(path)
    if not stripped:
        return TierPath()
    parts = stripped.split("/")
    if len(parts) > 3:
        raise InvalidName(
            f"tierckpt:// path {stripped[:160]!r} has {len(parts)} parts: use "
            "tierckpt://NAMESPACE/CHECKPOINT_ID[/FILE] (the namespace is the checkpoint folder)"
        )
    return TierPath(
        check_namespace(parts[0]),
        check_checkpoint_id(parts[1]) if len(parts) > 1 else "",
        check_file_name(parts[2]) if len(parts) > 2 else "",
    )


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

    def _checkpoint(self, p: TierPath, latest: str = "newest") -> CheckpointInfo:
        """The committed checkpoint `p` names. For `latest`: "newest" resolves it now,
        "bind" resolves it and remembers the answer for this load (DCP reads .metadata
        first), "bound" reuses that answer (the data files of the same load)."""
        client = self.client
        if p.checkpoint_id not in (LATEST, LATEST_VERIFIED):
            return client.get_checkpoint(p.namespace, p.checkpoint_id)
        key = (client.address, p.namespace, p.checkpoint_id)
        if latest == "bound":
            with _STATE_LOCK:
                bound = _LATEST.get(key)
            if bound is not None:
                return client.get_checkpoint(p.namespace, bound)
        info = client.get_checkpoint(p.namespace, None, verified=p.checkpoint_id == LATEST_VERIFIED)
        if latest == "bind":
            with _STATE_LOCK:
                _LATEST[key] = info.checkpoint_id
        return info

    @staticmethod
    def _writable(p: TierPath, what: str) -> None:
        if p.checkpoint_id in (LATEST, LATEST_VERIFIED):
            raise InvalidName(
                f"{what} tierckpt://{p.name}: {p.checkpoint_id!r} names the newest committed "
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
        if p.depth != 3:
            raise IsADirectoryError(f"tierckpt://{p.name} is not a file")
        if mode == "rb":
            return self._open_read(p)
        if mode == "wb":
            return self._open_write(p, autocommit)
        raise ValueError(f"tierckpt:// files are written once ('wb') and read ('rb'), not {mode!r}")

    def _open_write(self, p: TierPath, autocommit: bool) -> MemoryTierFile:
        self._writable(p, "cannot write")
        name, on_committed = p.file_name, None
        if name == METADATA_TMP:
            name, on_committed = METADATA_FILE, self._metadata_written
        elif name == METADATA_FILE:
            on_committed = self._metadata_written_final
        target = SaveTarget(p.namespace, p.checkpoint_id, _rank_for(name))
        # No set-up hook on this route: each file begins (or joins) the save.
        self.client.begin_checkpoint(target.namespace, target.checkpoint_id, target.rank)
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

    def _open_read(self, p: TierPath) -> io.IOBase:
        info = self._checkpoint(p, "bind" if p.file_name == METADATA_FILE else "bound")
        try:
            entry = info.file(p.file_name)
        except KeyError:
            raise FileNotFoundError(f"tierckpt://{p.name}: no such file") from None
        stream = ReadStream(self.client, info.namespace, info.checkpoint_id, entry)
        if p.file_name != METADATA_FILE:
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
        same = (p1.namespace, p1.checkpoint_id) == (p2.namespace, p2.checkpoint_id)
        if same and (p1.file_name, p2.file_name) == (METADATA_TMP, METADATA_FILE):
            self._writable(p2, "cannot commit")
            self._commit(p2.namespace, p2.checkpoint_id)
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
        client = self.client
        if p.depth < 2:
            raise PermissionError(
                f"tierckpt://{p.name}: remove checkpoints one by one "
                "(rm('tierckpt://NAMESPACE/CHECKPOINT_ID', recursive=True))"
            )
        self._writable(p, "cannot remove")
        if p.depth == 2:
            if not recursive:
                raise IsADirectoryError(
                    f"tierckpt://{p.name} is a checkpoint: rm(..., recursive=True) deletes it"
                )
            freed = client.delete_checkpoint(p.namespace, p.checkpoint_id)
            logger.info("removed tierckpt://%s (%d bytes freed)", p.name, freed)
            return
        # A file of a save in progress: DCP is cleaning up a failed write.
        try:
            client.abort_checkpoint(p.namespace, p.checkpoint_id)
        except CheckpointIncomplete:  # committed: its files are immutable
            raise PermissionError(
                f"tierckpt://{p.name} belongs to a committed checkpoint; its files cannot be "
                "removed one by one: rm the checkpoint with recursive=True"
            ) from None
        with _STATE_LOCK:
            _PENDING.pop((client.address, p.namespace, p.checkpoint_id), None)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Folders are implicit: a checkpoint appears when it commits. Checks the names,
        and `exist_ok=False` on a committed checkpoint raises FileExistsError."""
        p = parse_path(path)
        if p.depth == 3:
            raise NotADirectoryError(
                f"tierckpt://{p.name}: folders are NAMESPACE and NAMESPACE/CHECKPOINT_ID"
            )
        if p.depth == 2:
            self._writable(p, "cannot create")
            if not exist_ok and self.exists(path):
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

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        p = parse_path(path)
        client = self.client
        entries: list[dict[str, Any]]
        if p.depth == 0:
            names = client.status().namespaces
            entries = [{"name": ns, "type": "directory", "size": 0} for ns in names]
        elif p.depth == 1:
            entries = [
                self._checkpoint_entry(f"{p.namespace}/{c.checkpoint_id}", c)
                for c in client.list_checkpoints(p.namespace)
            ]
        elif p.depth == 2:
            info = self._checkpoint(p)
            entries = [
                {"name": f"{p.name}/{f.name}", "type": "file", "size": f.size, "rank": f.rank}
                for f in sorted(info.files, key=lambda f: f.name)
            ]
        else:
            entries = [self.info(path)]
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        p = parse_path(path)
        if p.depth == 0:
            return {"name": "", "type": "directory", "size": 0}
        if p.depth == 1:
            found = self.client.list_checkpoints(p.namespace)
            if not found:
                raise FileNotFoundError(f"tierckpt://{p.name} has no committed checkpoints")
            return {"name": p.name, "type": "directory", "size": 0, "checkpoints": len(found)}
        info = self._checkpoint(p)
        if p.depth == 2:
            return self._checkpoint_entry(p.name, info)
        if info.state == "LOST":
            # "isfile(step/.metadata)" is how frameworks find a loadable step: a checkpoint
            # with a file on no tier has none (it stays listed, with its state, for rm).
            raise FileNotFoundError(
                f"tierckpt://{p.name}: checkpoint {info.checkpoint_id} is LOST (a file has no "
                "copy left on any tier); load an older one"
            )
        try:
            f = info.file(p.file_name)
        except KeyError:
            raise FileNotFoundError(f"tierckpt://{p.name}: no such file") from None
        return {"name": p.name, "type": "file", "size": f.size, "rank": f.rank}

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
        return self._checkpoint(p)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        raise TierckptError("tierckpt:// cannot copy files: save the state under a new id")
