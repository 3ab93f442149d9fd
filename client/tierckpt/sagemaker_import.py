"""`tierckpt import-sagemaker`: checkpoints the SageMaker client wrote, as stock DCP.

The SageMaker tiered-checkpointing client (``amzn-sagemaker-checkpointing`` <= 1.1.3)
writes, per step N and rank R, ``<base>/<ns>/rank_R/step_N/checkpoint.pt`` (the rank's
items back to back: ``torch.save`` blobs and raw BYTE_IO bytes, which is byte for byte
a FileSystemWriter ``__R_0.distcp``) and, from the coordinator, a pickled DCP `Metadata`
``rank_0/step_N/metadata.metadata`` whose items are ``_SageMakerStorageInfo(rank, offset,
length)``. Converting one step therefore rewrites no data:

1. each referenced ``checkpoint.pt`` is copied to ``<dest>/<ns>/step_N/__R_0.distcp``
   (``fs.copy``: a server-side CopyObject on S3);
2. the copy is read once and hashed into tierckpt's xxh3 block checksums (a restore
   verifies every block against them; nothing vouches for the seed's bytes otherwise);
3. the persistent tier's bookkeeping is written as the daemon's drain writes it (format
   in ``tierckptd.persistent``: an upload marker per data file, the checkpoint's
   manifest, the original `.metadata`), so a daemon whose ``[persistent] url`` is
   `dest` adopts and restores the checkpoint like one it drained itself;
4. `.metadata` is written LAST (the commit marker stock DCP and the daemon look for),
   then the namespace's durable index entry ``<dest>/<ns>/.tierckpt/durable/step_N``
   (a re-run writes an entry a cut-off run left out, so listings find every step).

``metadata.metadata`` is a pickle from a bucket: it is decoded with the allow-list
decoder (`tierckpt.dcp_metadata`), the seed's storage-info class replaced by an inert
stand-in, never with plain pickle; no AWS package of the seed is imported. The converted
`.metadata` is shape-checked again before anything is written.

Checkpoint ids are ``step_N`` (the seed's own directory name), so the compat shim
(`tierckpt.compat.sagemaker`) and `persistent_keep_every` (the trailing integer) agree.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import fsspec
import xxhash

from tierckpt.checksum import DEFAULT_BLOCK_SIZE, BlockChecksums, BlockHasher, checksum_bytes
from tierckpt.dcp_metadata import (
    MAX_METADATA_BYTES,
    dump_metadata,
    load_metadata,
    unpickle_allowed,
)
from tierckpt.errors import CheckpointIncomplete, CheckpointNotFound, UnsafeMetadata
from tierckpt.names import METADATA_FILE, check_namespace

__all__ = [
    "ImportedStep",
    "converted_metadata",
    "import_sagemaker",
    "seed_steps",
    "step_checkpoint_id",
]

SEED_DATA = "checkpoint.pt"
SEED_METADATA = "metadata.metadata"
BOOKKEEPING_DIR = ".tierckpt"  # as tierckptd.persistent.store.BOOKKEEPING_DIR
DURABLE_INDEX = ".tierckpt/durable"  # as tierckptd.persistent.listing.INDEX_DIR
MANIFEST_OBJECT = "manifest.json"  # as tierckptd.persistent.listing.MANIFEST_OBJECT
METADATA_OBJECT = "metadata.orig"  # as tierckptd.persistent.source.METADATA_OBJECT
MANIFEST_FORMAT = 1  # as tierckptd.memory.manifest.FORMAT_VERSION
IMPORT_NODE = "import-sagemaker"
_READ_CHUNK = 8 << 20
_RANK_DIR = re.compile(r"rank_(\d+)$")
_STEP_DIR = re.compile(r"step_(\d+)$")
# Where the seed's storage-info dataclass lived (1.1.x, and the 1.0.x single module).
_SEED_INFO_MODULES = (
    "amzn_sagemaker_checkpointing.checkpointing.filesystem.storage_info",
    "amzn_sagemaker_checkpointing.checkpointing.filesystem.filesystem",
)


class _SeedStorageInfo:
    """Inert stand-in for the seed's ``_SageMakerStorageInfo(rank, offset, length)``:
    the unpickler builds it from the pickle's field dict; nothing runs."""

    rank: object
    offset: object
    length: object


def step_checkpoint_id(step: int) -> str:
    """The tierckpt checkpoint id of a SageMaker step (``step_100``)."""
    return f"step_{step}"


@dataclass(frozen=True)
class ImportedStep:
    step: int
    checkpoint_id: str
    files: int
    bytes: int
    skipped: bool  # already imported (its `.metadata` was there)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "id": self.checkpoint_id,
            "files": self.files,
            "bytes": self.bytes,
            "skipped": self.skipped,
        }


def _ls_dirs(fs: Any, path: str) -> list[str]:
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    return [str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] != "file"]


def seed_steps(fs: Any, root: str) -> dict[int, set[int]]:
    """``{step: {ranks that have a step_N directory}}`` under ``<root>`` (= base/ns)."""
    steps: dict[int, set[int]] = {}
    for rank_dir in _ls_dirs(fs, root):
        rank = _RANK_DIR.match(rank_dir)
        if rank is None:
            continue
        for step_dir in _ls_dirs(fs, f"{root}/{rank_dir}"):
            step = _STEP_DIR.match(step_dir)
            if step is not None:
                steps.setdefault(int(step.group(1)), set()).add(int(rank.group(1)))
    return steps


def converted_metadata(raw: bytes, what: str) -> tuple[bytes, dict[int, list[tuple[int, int]]]]:
    """The stock-DCP `.metadata` for the seed's pickle, and each rank's items."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    extra = {(m, "_SageMakerStorageInfo"): _SeedStorageInfo for m in _SEED_INFO_MODULES}
    md = unpickle_allowed(raw, what=what, extra_classes=extra)
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict) or not storage:
        raise UnsafeMetadata(f"{what}: refused, it has no storage_data items")
    items: dict[int, list[tuple[int, int]]] = {}
    converted: dict[Any, Any] = {}
    for key, info in storage.items():
        fields = getattr(info, "__dict__", {})
        rank, offset, length = (fields.get(f) for f in ("rank", "offset", "length"))
        if type(info) is not _SeedStorageInfo or not all(
            type(v) is int and 0 <= v < 2**63 for v in (rank, offset, length)
        ):
            raise UnsafeMetadata(
                f"{what}: refused, an item is {type(info).__name__}, not the SageMaker "
                "client's storage info (rank, offset, length)"
            )
        assert isinstance(rank, int) and isinstance(offset, int) and isinstance(length, int)
        converted[key] = _StorageInfo(f"__{rank}_0.distcp", offset, length)
        items.setdefault(rank, []).append((offset, length))
    md.storage_data = converted
    body = dump_metadata(md)
    load_metadata(body, what=what)  # the full shape check of a stock `.metadata`
    return body, items


def _hash_object(fs: Any, path: str) -> tuple[int, BlockChecksums]:
    """Size and block checksums of a stored object, read once in bounded chunks."""
    hasher = BlockHasher(DEFAULT_BLOCK_SIZE)
    with fs.open(path, "rb", block_size=_READ_CHUNK) as f:
        while chunk := f.read(_READ_CHUNK):
            hasher.update(chunk)
    return hasher.size, hasher.finish()


def _fingerprint(cs: BlockChecksums) -> str:
    # as tierckptd.persistent.markers.fingerprint
    return f"{cs.algorithm}:{cs.block_size}:{xxhash.xxh3_128_hexdigest(cs.digests)}"


def _file_doc(name: str, size: int, rank: int, cs: BlockChecksums) -> dict[str, Any]:
    return {
        "name": name,
        "size": size,
        "rank": rank,
        "algorithm": cs.algorithm,
        "block_size": cs.block_size,
        "block_digests": [cs.digest(i).hex() for i in range(cs.block_count)],
        "owner_node": "",
        "replica_nodes": [],
        "held": False,
    }


def _read_capped(fs: Any, path: str, what: str) -> bytes:
    """The seed's pickle, refused unread when larger than the decoder takes (a bucket is
    not trusted: never one unbounded read), and never more than its listed size."""
    size = int(fs.size(path))
    if size > MAX_METADATA_BYTES:
        raise UnsafeMetadata(
            f"{what}: refused unread, {size} bytes is more than the {MAX_METADATA_BYTES} a "
            "checkpoint's metadata may have"
        )
    return bytes(fs.cat_file(path, start=0, end=size)) if size else b""


def _mtime(fs: Any, path: str) -> float:
    """When the seed committed (its metadata object's time), else now; never later."""
    now = time.time()
    info = fs.info(path)
    for key in ("LastModified", "mtime", "created"):
        value = info.get(key)
        if hasattr(value, "timestamp"):
            value = value.timestamp()
        if isinstance(value, int | float) and value > 0:
            return min(float(value), now)
    return now


def _copy(src_fs: Any, dst_fs: Any, src: str, dst: str) -> None:
    """Server-side copy when both ends are the same filesystem, else a streamed one."""
    _mkdirs(dst_fs, dst)
    if src_fs is dst_fs or src_fs == dst_fs:
        src_fs.copy(src, dst)
        return
    with src_fs.open(src, "rb") as fin, dst_fs.open(dst, "wb") as fout:
        while chunk := fin.read(_READ_CHUNK):
            fout.write(chunk)


def _import_step(
    src_fs: Any, src_root: str, dst_fs: Any, dst_root: str, ns: str, step: int, ranks: set[int]
) -> ImportedStep:
    cid = step_checkpoint_id(step)
    ckpt = f"{dst_root}/{ns}/{cid}"
    index_entry = f"{dst_root}/{ns}/{DURABLE_INDEX}/{cid}"
    if dst_fs.exists(f"{ckpt}/{METADATA_FILE}"):
        # Imported before. A run cut off between `.metadata` and the index entry left a
        # step that listings (the index) would not show: write the entry now.
        if not dst_fs.exists(index_entry):
            _put(dst_fs, index_entry, b"")
        return ImportedStep(step, cid, 0, 0, skipped=True)
    md_rank = 0 if 0 in ranks else min(ranks)
    md_path = f"{src_root}/rank_{md_rank}/{cid}/{SEED_METADATA}"
    if not src_fs.exists(md_path):
        raise CheckpointIncomplete(
            f"step {step}: no {SEED_METADATA} under rank_{md_rank} (the SageMaker client "
            "never committed it, or it was saved to memory only)"
        )
    what = f"{ns}/rank_{md_rank}/{cid}/{SEED_METADATA}"
    metadata, items = converted_metadata(_read_capped(src_fs, md_path, what), what)
    committed = _mtime(src_fs, md_path)
    book = f"{dst_root}/{BOOKKEEPING_DIR}/{ns}/{cid}"
    files: list[dict[str, Any]] = []
    total = 0
    for rank in sorted(items):
        name = f"__{rank}_0.distcp"
        src = f"{src_root}/rank_{rank}/{cid}/{SEED_DATA}"
        if not src_fs.exists(src):
            raise CheckpointIncomplete(f"step {step}: rank_{rank}/{cid}/{SEED_DATA} is missing")
        _copy(src_fs, dst_fs, src, f"{ckpt}/{name}")
        size, cs = _hash_object(dst_fs, f"{ckpt}/{name}")
        end = max(offset + length for offset, length in items[rank])
        if end > size:
            raise CheckpointIncomplete(
                f"step {step}: rank_{rank}/{SEED_DATA} has {size} bytes, its items need {end}"
            )
        marker = {
            "name": name,
            "source_size": size,
            "size": size,
            "compression": "none",
            "index": None,
            "fingerprint": _fingerprint(cs),
        }
        _put(dst_fs, f"{book}/files/{name}.json", json.dumps(marker).encode())
        files.append(_file_doc(name, size, rank, cs))
        total += size
    files.append(_file_doc(METADATA_FILE, len(metadata), 0, checksum_bytes(metadata)))
    manifest = {
        "format": MANIFEST_FORMAT,
        "namespace": ns,
        "checkpoint_id": cid,
        "state": "COMMITTED",
        "sequence": step,  # ties of the commit time resolve by step
        "created_unix": committed,
        "committed_unix": committed,
        "pinned": False,
        "node_id": IMPORT_NODE,
        "files": sorted(files, key=lambda f: str(f["name"])),
    }
    _put(dst_fs, f"{book}/{MANIFEST_OBJECT}", json.dumps(manifest).encode())
    _put(dst_fs, f"{book}/{METADATA_OBJECT}", metadata)
    _put(dst_fs, f"{ckpt}/{METADATA_FILE}", metadata)  # the commit marker, last
    _put(dst_fs, index_entry, b"")
    return ImportedStep(step, cid, len(items) + 1, total + len(metadata), skipped=False)


def _mkdirs(fs: Any, path: str) -> None:
    """A local destination needs its directories; object stores have none."""
    if "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)


def _put(fs: Any, path: str, data: bytes) -> None:
    _mkdirs(fs, path)
    fs.pipe_file(path, data)


def import_sagemaker(
    src_url: str,
    namespace: str,
    *,
    dest_url: str | None = None,
    steps: Iterable[int] | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[ImportedStep], None] | None = None,
) -> list[ImportedStep]:
    """Convert the SageMaker client's checkpoints of `namespace` under `src_url` (its
    ``s3_tier_base_path``) into stock-DCP checkpoints ``<dest_url>/<namespace>/step_N``.

    Args:
        dest_url: the daemon's ``[persistent] url`` (default: `src_url`; the seed's
            ``rank_R/`` directories and tierckpt's ``step_N/`` ones do not collide).
        steps: the steps to import (default: every step with a ``metadata.metadata``).
        storage_options: for both URLs' filesystems (s3fs also reads the AWS
            environment, ``AWS_ENDPOINT_URL_S3`` included).

    Raises:
        CheckpointNotFound: nothing to import (or a requested step is not there).
        CheckpointIncomplete: a requested step lacks its metadata or a rank's data.
        UnsafeMetadata: a ``metadata.metadata`` that is not the seed's DCP metadata.
    """
    check_namespace(namespace)
    src_fs, src_root = fsspec.core.url_to_fs(src_url, **(storage_options or {}))
    dst_fs, dst_root = fsspec.core.url_to_fs(dest_url or src_url, **(storage_options or {}))
    src_root, dst_root = src_root.rstrip("/"), dst_root.rstrip("/")
    found = seed_steps(src_fs, f"{src_root}/{namespace}")
    wanted = sorted(found) if steps is None else sorted(set(steps))
    missing = [s for s in wanted if s not in found]
    if missing or not wanted:
        raise CheckpointNotFound(
            f"no SageMaker checkpoint of {namespace} under {src_url} for step(s) "
            f"{', '.join(map(str, missing)) or '(any)'}; found steps: "
            f"{', '.join(map(str, sorted(found))) or 'none'}"
        )
    done: list[ImportedStep] = []
    for step in wanted:
        root = f"{src_root}/{namespace}"
        if steps is None and not src_fs.exists(
            f"{root}/rank_{0 if 0 in found[step] else min(found[step])}/step_{step}/{SEED_METADATA}"
        ):
            continue  # not committed by the seed (memory only, or interrupted): not asked for
        result = _import_step(src_fs, root, dst_fs, dst_root, namespace, step, found[step])
        if progress is not None:
            progress(result)
        done.append(result)
    return done
