"""Manifests: the small JSON file that makes a checkpoint committed across restarts.

A manifest is written only at commit and on later state changes, atomically (tmp + fsync
+ rename + fsync of the directory), so after a crash or kill -9 a checkpoint either has a
complete manifest or none; a data directory without one is an unfinished save.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from tierckpt.checksum import BlockChecksums
from tierckpt.errors import InvalidName, MemoryBudgetExceeded
from tierckpt.names import (
    check_checkpoint_id,
    check_file_name,
    check_format,
    check_namespace,
    check_persistent_url,
)

from tierckptd.model import (
    MAX_NAMESPACE_KEEP_LAST,
    CheckpointRecord,
    FileRecord,
    State,
    Trust,
    coordinator_of,
)

__all__ = [
    "FORMAT_VERSION",
    "ManifestError",
    "atomic_write",
    "from_json",
    "read_manifest",
    "to_json",
    "write_manifest",
]

FORMAT_VERSION = 1
# Largest manifest read back from disk: digests of a 16 TiB checkpoint in 1 MiB blocks.
MAX_MANIFEST_BYTES = 1 << 30
MAX_UID = 0xFFFFFFFF  # (uid_t)-1 is no uid
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class ManifestError(ValueError):
    """A manifest cannot be parsed; the checkpoint it describes is not served."""


def atomic_write(path: Path, data: bytes, mode: int = 0o440) -> None:
    """Replace `path` with `data` so a reader sees the old or the new file, never a mix.

    The temp file has an unpredictable name and is created exclusively without following
    links; on any failure it is removed, and a full filesystem (ENOSPC/EDQUOT) raises
    MemoryBudgetExceeded (RESOURCE_EXHAUSTED) instead of a bare OSError.
    """
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise MemoryBudgetExceeded(
                f"memory tier: the filesystem of {path.parent} is full (writing the manifest "
                f"{path.name}); remove checkpoints (`tierckpt rm`), enlarge the tmpfs (size=) "
                "or lower [memory] budget below the tmpfs size"
            ) from e
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Persist a rename/unlink in `path` (a no-op cost on tmpfs, required on disks)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_json(record: CheckpointRecord) -> dict[str, Any]:
    files = []
    for f in sorted(record.files.values(), key=lambda f: f.name):
        assert f.checksums is not None, "only committed files are written to a manifest"
        cs = f.checksums
        files.append(
            {
                "name": f.name,
                "size": f.size,
                "rank": f.rank,
                "algorithm": cs.algorithm,
                "block_size": cs.block_size,
                "block_digests": [cs.digest(i).hex() for i in range(cs.block_count)],
                "owner_node": f.owner_node,
                "replica_nodes": list(f.replica_nodes),
                "held": f.held,
            }
        )
    return {
        "format": FORMAT_VERSION,
        "namespace": record.namespace,
        "checkpoint_id": record.checkpoint_id,
        "state": record.state.value,
        "sequence": record.sequence,
        "created_unix": record.created_unix,
        "committed_unix": record.committed_unix,
        "pinned": record.pinned,
        "durable_requested": record.durable_requested,
        "persistent_url": record.persistent_url,
        "memory_keep_last": record.memory_keep_last,
        "checkpoint_format": record.checkpoint_format,
        "node_id": record.node_id,
        "trust": record.trust.value,
        "owner_uid": record.owner_uid,
        "owner_claim_node": record.owner_claim_node,
        "files": files,
    }


def _flag(doc: dict[str, Any], key: str) -> bool:
    """An optional boolean field (absent in manifests written before it existed: False);
    anything but a JSON boolean is refused, so a damaged manifest is not read as a hint."""
    value = doc.get(key, False)
    if not isinstance(value, bool):
        raise ManifestError(f"malformed manifest: {key} is not a boolean")
    return value


def _owner(doc: dict[str, Any]) -> tuple[int | None, str]:
    """The optional namespace owner (absent before uid isolation travelled: None, "")."""
    uid, node = doc.get("owner_uid"), doc.get("owner_claim_node") or ""
    if uid is not None and (type(uid) is not int or not 0 <= uid < MAX_UID):
        raise ManifestError("malformed manifest: owner_uid is not a uid")
    if not isinstance(node, str) or len(node) > 128:
        raise ManifestError("malformed manifest: owner_claim_node is not a node id")
    return uid, node


def _keep_last(doc: dict[str, Any]) -> int:
    """The namespace's memory window (absent before it travelled: 0, none); anything but
    an integer in 0..MAX_NAMESPACE_KEEP_LAST is refused."""
    value = doc.get("memory_keep_last", 0)
    if type(value) is not int or not 0 <= value <= MAX_NAMESPACE_KEEP_LAST:
        raise ManifestError(
            f"malformed manifest: memory_keep_last is not an integer in "
            f"0..{MAX_NAMESPACE_KEEP_LAST}"
        )
    return value


def _checkpoint_format(doc: dict[str, Any]) -> str:
    """The checkpoint's format (absent in manifests written before it existed: DCP)."""
    try:
        return check_format(doc.get("checkpoint_format", ""))
    except InvalidName:
        raise ManifestError("malformed manifest: checkpoint_format is not a known format") from None


def _trust(doc: dict[str, Any], record: CheckpointRecord) -> Trust:
    """Whether the checkpoint may be its namespace's newest (`model.Trust`). Absent in a
    manifest written before it existed: PROVEN when the node that wrote the manifest
    coordinated it, else VOUCHED (it was newest-eligible then)."""
    value = doc.get("trust")
    if value is None:
        mine = coordinator_of(record.files) in ("", record.node_id)
        return Trust.PROVEN if mine else Trust.VOUCHED
    try:
        return Trust(value)
    except ValueError:
        raise ManifestError("malformed manifest: trust is not proven, vouched or foreign") from None


def from_json(doc: dict[str, Any]) -> CheckpointRecord:
    """Parse a manifest document; raises ManifestError naming what is wrong."""
    try:
        if doc["format"] != FORMAT_VERSION:
            raise ManifestError(f"unsupported manifest format {str(doc['format'])[:32]!r}")
        record = CheckpointRecord(
            namespace=check_namespace(doc["namespace"]),
            checkpoint_id=check_checkpoint_id(doc["checkpoint_id"]),
            state=State(doc["state"]),
            created_unix=float(doc["created_unix"]),
            committed_unix=float(doc["committed_unix"]),
            sequence=int(doc["sequence"]),
            pinned=bool(doc["pinned"]),
            node_id=str(doc["node_id"]),
            durable_requested=_flag(doc, "durable_requested"),
            persistent_url=check_persistent_url(doc.get("persistent_url", "")),
            memory_keep_last=_keep_last(doc),
            checkpoint_format=_checkpoint_format(doc),
        )
        record.owner_uid, record.owner_claim_node = _owner(doc)
        for f in doc["files"]:
            checksums = BlockChecksums(
                block_size=int(f["block_size"]),
                digests=b"".join(bytes.fromhex(d) for d in f["block_digests"]),
                algorithm=str(f["algorithm"]),
            )
            name = check_file_name(f["name"])
            record.files[name] = FileRecord(
                name=name,
                rank=int(f["rank"]),
                size=int(f["size"]),
                checksums=checksums,
                owner_node=str(f["owner_node"]),
                replica_nodes=[str(n) for n in f["replica_nodes"]],
                held=bool(f.get("held", True)),
            )
        record.trust = _trust(doc, record)
    except ManifestError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"malformed manifest: {type(e).__name__}: {str(e)[:200]}") from e
    return record


def write_manifest(path: Path, record: CheckpointRecord) -> None:
    atomic_write(path, json.dumps(to_json(record), indent=1).encode())


def read_manifest(path: Path) -> CheckpointRecord:
    """Parse the manifest at `path`; a link or non-regular file is refused, not followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                raise ManifestError(
                    f"manifest {path.name} is not a regular file of at most "
                    f"{MAX_MANIFEST_BYTES} bytes"
                )
            with open(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        finally:
            os.close(fd)
        doc = json.loads(raw)
    except OSError as e:
        raise ManifestError(f"cannot read manifest {path.name}: {os.strerror(e.errno or 0)}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"cannot read manifest {path.name}: {str(e)[:200]}") from e
    if not isinstance(doc, dict):
        raise ManifestError(f"manifest {path.name} is not a JSON object")
    return from_json(doc)
