"""The persistent tier: DCP checkpoints under any fsspec URL (s3:// through s3fs).

Layout under ``url``::

    <url>/<namespace>/<checkpoint_id>/__0_0.distcp ...   the DCP data files
    <url>/<namespace>/<checkpoint_id>/.metadata          uploaded last: the commit marker
    <url>/.tierckpt/<namespace>/<flat id>/files/<name>.json
                                                         one upload marker per data file
    <url>/.tierckpt/<namespace>/<flat id>/files-commit.json
                                                         a "files" checkpoint's commit

A checkpoint of another format than DCP ("files": `tierckpt.names.FORMATS`) has no
`.metadata` to decode: all its files are data, uploaded verbatim, and the commit marker
`files_commit` (listing each file, its size and checksum fingerprint) is PUT last.

An id that is a folder path (``run1/step-10``) nests as a local folder would
(``<url>/<ns>/run1/step-10/.metadata``), so stock DCP opens ``<url>/<ns>/run1/step-10``;
its bookkeeping is one flat directory (`tierckpt.names.flat_checkpoint_id`,
``run1+step-10``), so one checkpoint's bookkeeping never holds another's. A checkpoint
may be a folder of another (``run1`` and ``run1/step-10``): deleting one removes its own
files only.

A checkpoint directory holds exactly the files stock DCP reads, so
``dcp.load(sd, checkpoint_id="<url>/<ns>/<id>")`` works without tierckpt. Bookkeeping
lives outside it. A data file's marker records what was uploaded (sizes, compression,
the per-item zstd index); it is removed before the object is rewritten and written
after the object is complete, so a marker never describes bytes that are not there.
`upload_metadata_last` commits: it checks that every data file `.metadata` names has a
marker and an object of that size, rewrites `.metadata` for the compressed files, and
PUTs it (atomic per object). Without `.metadata` a checkpoint is not durable.

Every remote operation runs under a declared `RetryPolicy` and, at shutdown or a caller's
wish, a deadline (`persistent.retry.Calls`); what a failure means, and the client
settings of each backend, is the backend's entry in `persistent.errors`.

What is read back from the store is not trusted: names that are not valid namespaces or
checkpoint ids are skipped when listing, and an upload marker whose fields are out of
range is ignored (the file counts as not uploaded, and the next drain rewrites it).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
from tierckpt.errors import CheckpointIncomplete, InvalidName
from tierckpt.names import (
    FORMAT_DCP,
    FORMAT_FILES,
    METADATA_FILE,
    check_checkpoint_id,
    check_file_name,
    check_namespace,
    checkpoint_id_of_flat,
    flat_checkpoint_id,
    is_checkpoint_id,
    step_of,
)

from tierckptd.model import FileRecord
from tierckptd.ops.faults import fault
from tierckptd.persistent.errors import Backend, PersistentTierUnavailable, backend_for
from tierckptd.persistent.files_commit import FILES_COMMIT_OBJECT, FilesCommit
from tierckptd.persistent.format import (
    DEFAULT_CHUNK_SIZE,
    FileIndex,
    Item,
    RangeSource,
    compress_items,
    data_files,
    rewrite_metadata,
)
from tierckptd.persistent.markers import (
    COMPRESSIONS,
    FileUpload,
    Source,
    UploadedFile,
    as_range_source,
    check_relative_path,
    fingerprint,
)
from tierckptd.persistent.retry import Calls, Op, RetryPolicy

if TYPE_CHECKING:
    from tierckptd.config import PersistentConfig

__all__ = [
    "BOOKKEEPING_DIR",
    "COMPRESSIONS",
    "FileUpload",
    "Op",
    "PersistentTier",
    "PersistentTierUnavailable",
    "RetryPolicy",
    "UploadedFile",
]

logger: logging.Logger = logging.getLogger(__name__)

BOOKKEEPING_DIR = ".tierckpt"
DEFAULT_BLOCK_SIZE = 64 << 20  # multipart part size: few requests, 640 GB per object
_MAX_PARTS = 9_000  # below S3's 10,000 with room to spare
# An upload marker larger than this is not read (a tampered bucket): ours
# hold ~40 bytes per item, so 64 MiB is over a million items in one data file.
MAX_MARKER = 64 << 20
MAX_UPLOADS_LISTED = 100_000  # open multipart uploads looked at per root at start

T = TypeVar("T")


@dataclass
class _Counter:
    written: int = 0
    index: FileIndex | None = field(default=None)


class PersistentTier:
    """One persistent-tier root (an fsspec URL) and the operations a drain needs.

    Thread-safe: uploads from many threads share one bounded set of upload slots
    (`max_concurrency` files in flight); s3fs multiplexes them on its own event loop.

    Args:
        url: any fsspec URL (``s3://bucket/prefix``, ``file:///dir``, ...).
        storage_options: passed to ``fsspec.core.url_to_fs`` (``endpoint_url``,
            ``key``/``secret``, ``config_kwargs``, ...), with the backend's client
            defaults filled in where they are not set (`Backend.client_options`).
        compression: "zstd" (per-item frames, see `persistent_format`) or "none".
        level: zstd level.
        max_concurrency: data files uploaded at once.
        retry: the policy for every remote operation.
        block_size: multipart part size (grown for huge files to stay under S3's part
            limit); each upload in flight buffers one part.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        compression: str = "zstd",
        level: int = 3,
        max_concurrency: int = 4,
        retry: RetryPolicy | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 ({max_concurrency=})")
        self.url = url
        self.backend: Backend = backend_for(url)
        self.calls = Calls(retry or RetryPolicy(), self.backend, sleep=sleep, clock=clock)
        options = self.backend.client_options(dict(storage_options or {}))
        fs, root = fsspec.core.url_to_fs(url, **options)
        cap = self.backend.library_retries
        if cap is not None and isinstance(getattr(fs, "retries", None), int):
            fs.retries = min(fs.retries, cap)
        self.fs: Any = fs
        self.root: str = root.rstrip("/")
        self.compression = compression
        self.level = level
        self.max_concurrency = max_concurrency
        self.block_size = block_size
        self._slots = threading.BoundedSemaphore(max_concurrency)

    @classmethod
    def from_config(cls, config: PersistentConfig, **kwargs: Any) -> PersistentTier:
        """A tier for ``[persistent]``; `kwargs` as in the constructor."""
        return cls(
            config.url,
            dict(config.storage_options),
            compression=config.compression,
            level=config.level,
            **kwargs,
        )

    # ---- calls: retried, deadline-bounded (`Calls`) --------------------------------

    def retrying(self, fn: Callable[[], T], what: str, op: Op) -> T:
        """`fn` under the retry policy and the deadlines; `what` names it in errors and
        logs, `op` in the error metric."""
        return self.calls.run(fn, what, op)

    def set_deadline(self, seconds: float | None) -> None:
        """Shutdown: every operation, in flight or not, gives up `seconds` from now."""
        self.calls.set_deadline(seconds)

    def within(self, seconds: float) -> AbstractContextManager[None]:
        """Every operation this thread starts inside gives up `seconds` from now."""
        return self.calls.within(seconds)

    # ---- objects: one fsspec call each, retried by the caller ---------------------

    def find(self, path: str, *, detail: bool = False) -> Any:
        """Every object under `path`, flat; an unreadable local directory raises (an
        outage), where fsspec's walk would skip it as if empty."""
        if self.backend.local:
            return self.fs.find(path, detail=detail, on_error="raise")
        return self.fs.find(path, detail=detail)

    def _mkdirs(self, path: str) -> None:
        if self.backend.local:  # object stores have no directories to create
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)

    def put_object(self, path: str, data: bytes) -> None:
        self._mkdirs(path)
        self.fs.pipe_file(path, data)
        self.fs.invalidate_cache(path)

    def remove_object(self, path: str, *, recursive: bool = False) -> None:
        self.fs.invalidate_cache(path)
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

    # ---- paths -------------------------------------------------------------------

    def checkpoint_path(self, namespace: str, checkpoint_id: str) -> str:
        """The checkpoint's directory as the filesystem names it (no protocol)."""
        check_namespace(namespace)
        check_checkpoint_id(checkpoint_id)
        if namespace == BOOKKEEPING_DIR:
            raise InvalidName(f"namespace {namespace!r} is reserved for tierckpt's bookkeeping")
        return f"{self.root}/{namespace}/{checkpoint_id}"

    def checkpoint_url(self, namespace: str, checkpoint_id: str) -> str:
        """The URL stock DCP loads: ``dcp.load(sd, checkpoint_id=tier.checkpoint_url(...))``."""
        return str(self.fs.unstrip_protocol(self.checkpoint_path(namespace, checkpoint_id)))

    def _bookkeeping_path(self, namespace: str, checkpoint_id: str) -> str:
        self.checkpoint_path(namespace, checkpoint_id)
        return f"{self.root}/{BOOKKEEPING_DIR}/{namespace}/{flat_checkpoint_id(checkpoint_id)}"

    def commit_path(self, namespace: str, checkpoint_id: str, *, files: bool) -> str:
        """The object whose presence commits the checkpoint here: DCP's `.metadata`, or a
        "files" checkpoint's `files-commit.json` marker."""
        if files:
            return f"{self._bookkeeping_path(namespace, checkpoint_id)}/{FILES_COMMIT_OBJECT}"
        return f"{self.checkpoint_path(namespace, checkpoint_id)}/{METADATA_FILE}"

    def _marker_path(self, namespace: str, checkpoint_id: str, name: str) -> str:
        return f"{self._bookkeeping_path(namespace, checkpoint_id)}/files/{name}.json"

    # ---- uploads -----------------------------------------------------------------

    def upload_file(
        self,
        namespace: str,
        checkpoint_id: str,
        name: str,
        source: Source,
        size: int | None = None,
        *,
        items: Sequence[Item] | None = None,
        fingerprint: str = "",
        any_name: bool = False,
    ) -> UploadedFile:
        """Upload one data file (streaming, multipart), then its marker.

        With compression "zstd" and `items` given (from `persistent_format.data_files`),
        each item is compressed into its own frame on the way up and the frame index
        goes into the marker for `upload_metadata_last`; otherwise the bytes go up
        verbatim. Reading a `VerifiedFile` source verifies every block; a mismatch
        (`ChecksumMismatch`) raises at once. Idempotent: uploading the same file again
        rewrites the same object. Never call it for a checkpoint that is durable.

        Args:
            size: the source's size, checked when given.
            any_name: a file of a "files" checkpoint, where `.metadata` is data too.

        Raises:
            PersistentTierUnavailable: the tier stayed down past the retry policy.
        """
        checked = check_relative_path(name, data_only=not any_name)
        path = f"{self.checkpoint_path(namespace, checkpoint_id)}/{checked}"
        marker = self._marker_path(namespace, checkpoint_id, name)
        src = as_range_source(source)
        if size is not None and src.size != size:
            raise ValueError(f"{name}: the source has {src.size} bytes, expected {size}")
        compress = self.compression == "zstd" and items is not None
        what = f"upload {namespace}/{checkpoint_id}/{name}"
        with self._slots:
            started = time.monotonic()
            # The old marker goes first: it must never describe a half-rewritten object.
            self.retrying(lambda: self.remove_object(marker), f"{what} (clear marker)", Op.UPLOAD)
            counter = self.retrying(
                lambda: self._write_object(path, src, items if compress else None), what, Op.UPLOAD
            )
        uploaded = UploadedFile(
            name=name,
            source_size=src.size,
            size=counter.written,
            compression="zstd" if compress else "none",
            index=counter.index,
            fingerprint=fingerprint,
        )
        fault("drain.marker")
        self.retrying(
            lambda: self.put_object(marker, uploaded.to_json()), f"{what} (marker)", Op.UPLOAD
        )
        logger.info(
            "uploaded %s: %d bytes as %d (%s) in %.2fs",
            path,
            src.size,
            counter.written,
            uploaded.compression,
            time.monotonic() - started,
        )
        return uploaded

    def _write_object(self, path: str, src: RangeSource, items: Sequence[Item] | None) -> _Counter:
        self._mkdirs(path)
        block = max(self.block_size, -(-src.size // _MAX_PARTS))
        counter = _Counter()
        f = self.fs.open(path, "wb", block_size=block)
        try:
            if items is not None:
                counter.index = compress_items(src, items, f, level=self.level)
                counter.written = sum(length for _, length in counter.index.values())
            else:
                for start in range(0, src.size, DEFAULT_CHUNK_SIZE):
                    data = src.read(start, min(DEFAULT_CHUNK_SIZE, src.size - start))
                    f.write(data)
                    counter.written += len(data)
            f.close()
        except BaseException:
            _discard_partial_write(f, path)
            raise
        self.fs.invalidate_cache(path)
        stored = int(self.fs.size(path))
        if stored != counter.written:  # retried: the next attempt rewrites the object
            raise OSError(f"{path}: wrote {counter.written} bytes but the store has {stored}")
        return counter

    def upload_files(
        self, namespace: str, checkpoint_id: str, uploads: Iterable[FileUpload]
    ) -> list[UploadedFile]:
        """`upload_file` for many files, `max_concurrency` at a time, in input order.

        Every upload runs to its end; then the first failure, if any, is raised.
        """
        with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="upload") as pool:
            futures = [
                pool.submit(
                    self.upload_file,
                    namespace,
                    checkpoint_id,
                    u.name,
                    u.source,
                    u.size,
                    items=u.items,
                    fingerprint=u.fingerprint,
                    any_name=u.any_name,
                )
                for u in uploads
            ]
        return [f.result() for f in futures]

    def uploaded(self, namespace: str, checkpoint_id: str) -> dict[str, UploadedFile]:
        """The markers of the data files already uploaded for a checkpoint, by name."""
        files_dir = f"{self._bookkeeping_path(namespace, checkpoint_id)}/files"

        def read() -> dict[str, UploadedFile]:
            self.fs.invalidate_cache(files_dir)
            try:
                listed = self.find(files_dir, detail=True)
            except FileNotFoundError:
                return {}
            paths: list[str] = []
            for p, info in sorted(listed.items()):
                size = int(info.get("size") or 0)
                if 0 < size <= MAX_MARKER:
                    paths.append(p)
                else:  # a tampered bucket: never read whole
                    logger.warning(
                        "%s: ignored, %d bytes is not an upload marker (the file counts as "
                        "not uploaded)",
                        p,
                        size,
                    )
            if not paths:
                return {}
            # As listed, never more: an object grown since is cut and fails to parse.
            ends = [int(listed[p]["size"]) for p in paths]
            blobs = self.fs.cat_ranges(paths, [0] * len(paths), ends, on_error="return")
            markers: dict[str, UploadedFile] = {}
            for p, blob in zip(paths, blobs, strict=True):
                if isinstance(blob, FileNotFoundError):
                    continue  # removed since it was listed: not uploaded
                if isinstance(blob, BaseException):
                    raise blob
                try:
                    m = UploadedFile.from_json(bytes(blob))
                except ValueError as e:
                    logger.warning("%s: ignored (the file counts as not uploaded): %s", p, e)
                    continue
                if f"{m.name}.json" != str(p).rsplit("/", 1)[-1]:
                    logger.warning("%s: ignored, it describes another file", p)
                    continue
                markers[m.name] = m
            return markers

        return self.retrying(read, f"list uploads of {namespace}/{checkpoint_id}", Op.LIST)

    def upload_metadata_last(self, namespace: str, checkpoint_id: str, metadata: bytes) -> bytes:
        """Commit the checkpoint: PUT `.metadata` once every data file it names is there.

        `metadata` is the memory tier's `.metadata`; for compressed files it is
        rewritten with their frame indexes (`persistent_format.rewrite_metadata`).
        Returns the bytes uploaded.

        Raises:
            CheckpointIncomplete: a data file has no marker, or its object is missing or
                has another size; nothing was committed.
            PersistentTierUnavailable: the tier stayed down past the retry policy.
        """
        ckpt = self.checkpoint_path(namespace, checkpoint_id)
        what = f"{namespace}/{checkpoint_id}/{METADATA_FILE}"
        needed = sorted(data_files(metadata, what=what))
        for name in needed:
            check_relative_path(name)
        markers = self.uploaded(namespace, checkpoint_id)

        sizes = self._stored_sizes(namespace, checkpoint_id)
        problems = [
            name for name in needed if name not in markers or sizes.get(name) != markers[name].size
        ]
        if problems:
            shown = ", ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
            raise CheckpointIncomplete(
                f"{namespace}/{checkpoint_id}: {len(problems)} data file(s) not (fully) in the "
                f"persistent tier: {shown}; upload them before .metadata"
            )
        mappings: dict[str, FileIndex] = {}
        for name in needed:
            index = markers[name].index
            if index is not None:
                mappings[name] = index
        body = rewrite_metadata(metadata, mappings, what=what)
        path = f"{ckpt}/{METADATA_FILE}"
        self.retrying(
            lambda: self.put_object(path, body),
            f"commit {namespace}/{checkpoint_id}/.metadata",
            Op.UPLOAD,
        )
        logger.info("%s/%s is durable at %s", namespace, checkpoint_id, self.url)
        return body

    def _stored_sizes(self, namespace: str, checkpoint_id: str) -> dict[str, int]:
        """Size of every object under the checkpoint's directory, listed fresh (a commit
        checks what is really up, not a cached listing)."""
        ckpt = self.checkpoint_path(namespace, checkpoint_id)

        def stored_sizes() -> dict[str, int]:
            self.fs.invalidate_cache(ckpt)
            try:
                found = self.find(ckpt, detail=True)
            except FileNotFoundError:
                return {}
            return {p[len(ckpt) + 1 :]: int(info["size"]) for p, info in found.items()}

        return self.retrying(stored_sizes, f"list {namespace}/{checkpoint_id}", Op.LIST)

    def commit_files_last(
        self, namespace: str, checkpoint_id: str, files: Sequence[FileRecord]
    ) -> None:
        """Commit a "files" checkpoint: PUT its commit marker (`files_commit`) once every
        file has an upload marker of its bytes (the fingerprint of its checksums) and an
        object of that size.

        Raises:
            CheckpointIncomplete: a file is not (fully) up; nothing was committed.
            PersistentTierUnavailable: the tier stayed down past the retry policy.
        """
        for f in files:
            check_relative_path(f.name, data_only=False)
        markers = self.uploaded(namespace, checkpoint_id)

        sizes = self._stored_sizes(namespace, checkpoint_id)
        problems = [
            f.name
            for f in files
            if (m := markers.get(f.name)) is None
            or m.fingerprint != fingerprint(f)
            or sizes.get(f.name) != m.size
        ]
        if problems:
            shown = ", ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
            raise CheckpointIncomplete(
                f"{namespace}/{checkpoint_id}: {len(problems)} file(s) not (fully) in the "
                f"persistent tier: {shown}; upload them before the commit marker"
            )
        self.put_bookkeeping(
            namespace,
            checkpoint_id,
            FILES_COMMIT_OBJECT,
            FilesCommit.of(namespace, checkpoint_id, files).to_json(),
        )
        logger.info("%s/%s is durable at %s", namespace, checkpoint_id, self.url)

    # ---- bookkeeping ---------------------------------------------------------------

    def put_bookkeeping(self, namespace: str, checkpoint_id: str, name: str, data: bytes) -> None:
        """Store a small object beside the markers (outside the checkpoint directory)."""
        check_file_name(name)
        path = f"{self._bookkeeping_path(namespace, checkpoint_id)}/{name}"
        self.retrying(
            lambda: self.put_object(path, data),
            f"write {namespace}/{checkpoint_id} {name}",
            Op.UPLOAD,
        )

    def read_bookkeeping(
        self, namespace: str, checkpoint_id: str, name: str, *, max_bytes: int = 1 << 30
    ) -> bytes | None:
        """A bookkeeping object stored by `put_bookkeeping`, or None if there is none.

        Raises:
            ValueError: it is larger than `max_bytes` (a tampered bucket); not read whole.
        """
        check_file_name(name)
        path = f"{self._bookkeeping_path(namespace, checkpoint_id)}/{name}"

        def read() -> bytes | None:
            try:
                return bytes(self.fs.cat_file(path, start=0, end=max_bytes + 1))
            except FileNotFoundError:
                return None

        data = self.retrying(read, f"read {namespace}/{checkpoint_id} {name}", Op.READ)
        if data is not None and len(data) > max_bytes:
            raise ValueError(
                f"{namespace}/{checkpoint_id} {name} in the persistent tier is larger than "
                f"{max_bytes} bytes; refused"
            )
        return data

    # ---- queries -----------------------------------------------------------------

    def is_durable(
        self, namespace: str, checkpoint_id: str, checkpoint_format: str | None = None
    ) -> bool:
        """Whether the checkpoint's commit marker is in the tier (an outage raises): its
        `.metadata` for "dcp", its bookkeeping `files_commit` marker for "files", either
        when the format is not known yet (adoption reads it from the manifest, and then
        checks the marker its format has: `listing.adopt_checkpoint`)."""
        dcp = f"{self.checkpoint_path(namespace, checkpoint_id)}/{METADATA_FILE}"
        files = f"{self._bookkeeping_path(namespace, checkpoint_id)}/{FILES_COMMIT_OBJECT}"
        paths = {FORMAT_DCP: [dcp], FORMAT_FILES: [files]}.get(
            checkpoint_format or "", [dcp, files]
        )

        def probe() -> bool:
            for path in paths:
                self.fs.invalidate_cache(path)
                try:
                    self.fs.info(path)
                except FileNotFoundError:
                    continue
                return True
            return False

        return self.retrying(probe, f"probe {namespace}/{checkpoint_id}", Op.READ)

    def list_namespaces(self) -> list[str]:
        """Namespaces with anything under the root (durable or not), sorted."""

        def scan() -> list[str]:
            self.fs.invalidate_cache(self.root)
            try:
                found = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
            return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]

        names = self.retrying(scan, f"list {self.url}", Op.LIST)
        return sorted(n for n in set(names) if n != BOOKKEEPING_DIR and _valid_namespace(n))

    def list_durable(self, namespace: str) -> list[str]:
        """Ids of the namespace's durable checkpoints, by step, then id."""
        check_namespace(namespace)
        base = f"{self.root}/{namespace}"

        def scan() -> list[str]:
            self.fs.invalidate_cache()
            try:
                return [str(p) for p in self.find(base)]
            except FileNotFoundError:
                return []

        found = self.retrying(scan, f"list {namespace}", Op.LIST)
        ids, bad = metadata_ids(found, base)
        ids |= self._files_committed_ids(namespace)
        if bad:
            logger.warning(
                "%s: skipped %d object(s) whose checkpoint id is not valid, e.g. %.64r",
                namespace,
                len(bad),
                bad[0],
            )
        # A `.metadata` without tierckpt's bookkeeping is not a checkpoint this deployment
        # drained (junk in a shared bucket): retention neither counts it among
        # the newest (it would evict real ones) nor deletes it.
        foreign = ids - self.bookkept_ids(namespace) if ids else set()
        if foreign:
            logger.info(
                "%s: %d .metadata object(s) without tierckpt bookkeeping ignored, e.g. %s",
                namespace,
                len(foreign),
                sorted(foreign)[0],
            )
        return sorted(ids - foreign, key=step_order)

    def _files_committed_ids(self, namespace: str) -> set[str]:
        """Ids of the namespace's "files" checkpoints with a commit marker (one listing of
        its bookkeeping; invalid names skipped)."""
        base = f"{self.root}/{BOOKKEEPING_DIR}/{check_namespace(namespace)}"

        def scan() -> list[str]:
            self.fs.invalidate_cache(base)
            try:
                return [str(p) for p in self.find(base)]
            except FileNotFoundError:
                return []

        ids: set[str] = set()
        for p in self.retrying(scan, f"list {namespace} bookkeeping", Op.LIST):
            flat, _, name = p[len(base) + 1 :].partition("/")
            if name != FILES_COMMIT_OBJECT:
                continue
            try:
                ids.add(checkpoint_id_of_flat(flat))
            except InvalidName:
                continue
        return ids

    def bookkept_ids(self, namespace: str) -> set[str]:
        """Ids with a bookkeeping directory (``<url>/.tierckpt/<ns>/<id>/``: upload markers,
        the manifest), valid ones only: one delimiter listing."""
        base = f"{self.root}/{BOOKKEEPING_DIR}/{check_namespace(namespace)}"

        def scan() -> list[str]:
            self.fs.invalidate_cache(base)
            try:
                found = self.fs.ls(base, detail=False)
            except FileNotFoundError:
                return []
            return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]

        ids: set[str] = set()
        for n in self.retrying(scan, f"list {namespace} bookkeeping", Op.LIST):
            try:
                ids.add(checkpoint_id_of_flat(n))
            except InvalidName:
                continue
        return ids

    def read_range(
        self, namespace: str, checkpoint_id: str, name: str, offset: int, length: int
    ) -> bytes:
        """Bytes ``[offset, offset+length)`` of a file as stored (compressed if it is)."""
        if offset < 0 or length < 0:
            raise ValueError(f"bad range ({offset=}, {length=})")
        path = (
            f"{self.checkpoint_path(namespace, checkpoint_id)}/"
            f"{check_relative_path(name, data_only=False)}"
        )
        if length == 0:
            return b""

        def read() -> bytes:
            data = bytes(self.fs.cat_file(path, start=offset, end=offset + length))
            if len(data) != length:
                raise EOFError(
                    f"{path}: range {offset}..{offset + length} is past its end "
                    f"({len(data)} bytes there)"
                )
            return data

        return self.retrying(read, f"read {namespace}/{checkpoint_id}/{name}", Op.READ)

    # ---- open multipart uploads --------------------------------------------------

    def abort_uploads(self, files: Iterable[tuple[str, str, str]]) -> int:
        """Abort the open multipart uploads of these data files ((namespace, id, name)):
        a kill -9 mid-upload leaves its upload open for good, and S3 bills its parts.
        Call it before this node uploads any of them again. One listing of the root's
        open uploads (at most MAX_UPLOADS_LISTED), then one abort per match; only S3
        roots have uploads (0 elsewhere). Returns uploads aborted.

        Raises:
            PersistentTierUnavailable: the listing failed (an abort that fails only warns).
        """
        call = getattr(self.fs, "call_s3", None)
        if call is None or not hasattr(self.fs, "split_path"):
            return 0
        wanted: set[str] = set()
        for namespace, checkpoint_id, name in files:
            path = f"{self.checkpoint_path(namespace, checkpoint_id)}/{check_relative_path(name)}"
            wanted.add(self.fs.split_path(path)[1])
        if not wanted:
            return 0
        bucket, root_key, _ = self.fs.split_path(self.root)
        prefix = f"{root_key.rstrip('/')}/" if root_key else ""

        def listing() -> list[tuple[str, str]]:
            found: list[tuple[str, str]] = []
            page: dict[str, str] = {}
            while len(found) < MAX_UPLOADS_LISTED:
                out = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **page)
                found += [(str(u["Key"]), str(u["UploadId"])) for u in out.get("Uploads") or []]
                if not out.get("IsTruncated"):
                    break
                page = {
                    "KeyMarker": str(out.get("NextKeyMarker") or ""),
                    "UploadIdMarker": str(out.get("NextUploadIdMarker") or ""),
                }
            return found

        aborted = 0
        for key, upload_id in self.retrying(
            listing, f"list open uploads under {self.url}", Op.LIST
        ):
            if key not in wanted:
                continue  # another node's, or not a file this node uploads
            try:
                self.retrying(
                    functools.partial(
                        call, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id
                    ),
                    f"delete the open upload of {key}",
                    Op.DELETE,
                )
            except (PersistentTierUnavailable, OSError) as e:
                logger.warning("could not abort the open upload of %s: %s", key, e)
                continue
            aborted += 1
            logger.info("aborted the open multipart upload of %s (left by a killed drain)", key)
        return aborted

    # ---- deletion ----------------------------------------------------------------

    def delete(self, namespace: str, checkpoint_id: str) -> None:
        """Remove a checkpoint: `.metadata` first, so it stops being durable at once.

        Then the data files, then the bookkeeping. Idempotent; an interrupted delete
        leaves a non-durable remainder that the next call finishes.
        """
        ckpt = self.checkpoint_path(namespace, checkpoint_id)
        what = f"delete {namespace}/{checkpoint_id}"
        self.retrying(
            lambda: self.remove_object(f"{ckpt}/{METADATA_FILE}"), f"{what} (.metadata)", Op.DELETE
        )
        marker = f"{self._bookkeeping_path(namespace, checkpoint_id)}/{FILES_COMMIT_OBJECT}"
        self.retrying(lambda: self.remove_object(marker), f"{what} (commit marker)", Op.DELETE)
        self.retrying(lambda: self._remove_own_files(ckpt), f"{what} (data)", Op.DELETE)
        book = self._bookkeeping_path(namespace, checkpoint_id)
        self.retrying(
            lambda: self.remove_object(book, recursive=True), f"{what} (bookkeeping)", Op.DELETE
        )
        logger.info("deleted %s/%s from %s", namespace, checkpoint_id, self.url)

    def _remove_own_files(self, ckpt: str) -> None:
        """Remove a checkpoint's directory, or only its own files when it is also the folder
        of other checkpoints (``run1`` beside ``run1/step-10``)."""
        try:
            found = [str(p) for p in self.find(ckpt)]
        except FileNotFoundError:
            found = []
        own = [p for p in found if "/" not in p[len(ckpt) + 1 :]]
        if len(own) == len(found):
            self.remove_object(ckpt, recursive=True)
            return
        for p in own:
            self.remove_object(p)


def metadata_ids(paths: Iterable[str], base: str) -> tuple[set[str], list[str]]:
    """The checkpoint ids under `base` that the listed `paths` show a ``.metadata`` for
    (``<base>/run1/step-10/.metadata`` -> ``run1/step-10``), and the names refused.
    Bookkeeping under ``<base>/.tierckpt`` is no checkpoint (no nested id starts with a
    "."); every name is validated."""
    ids: set[str] = set()
    bad: list[str] = []
    prefix = f"{base}/"
    for p in paths:
        rel = p[len(prefix) :] if p.startswith(prefix) else ""
        folder, _, name = rel.rpartition("/")
        if name != METADATA_FILE or not folder or folder.startswith(f"{BOOKKEEPING_DIR}/"):
            continue
        if is_checkpoint_id(folder):
            ids.add(folder)
        else:
            bad.append(folder)
    return ids, sorted(bad)


def _discard_partial_write(f: Any, path: str) -> None:
    """Abandon a failed write without committing it (aborts an S3 multipart upload)."""
    buffered = callable(getattr(f, "discard", None)) and hasattr(f, "buffer")
    try:
        if buffered:
            f.discard()
        else:
            f.close()  # local files: a partial object is harmless without its marker
    except Exception:
        logger.warning("could not abandon the partial upload of %s", path, exc_info=True)
    finally:
        if buffered:
            # Never let close() or __del__ complete this upload later: a stale partial
            # object could overwrite the one a successful retry wrote meanwhile.
            f.closed = True


def _valid_namespace(name: str) -> bool:
    try:
        check_namespace(name)
    except InvalidName:
        logger.warning("skipped %.64r under the persistent tier: not a valid namespace", name)
        return False
    return True


def step_order(checkpoint_id: str) -> tuple[int, int, str]:
    step = step_of(checkpoint_id)
    return (0, step, checkpoint_id) if step is not None else (1, 0, checkpoint_id)
