"""Manifests: the small JSON file that makes a checkpoint committed across restarts.

A manifest is written only at commit and on later state changes, atomically (tmp + fsync
+ rename + fsync of the directory), so after a crash or kill -9 a checkpoint either has a
complete manifest or none; a data directory without one is an unfinished save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tierckpt.checksum import BlockChecksums
from tierckpt.names import check_checkpoint_id, check_file_name, check_namespace

from tierckptd.model import CheckpointRecord, FileRecord, State

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


class ManifestError(ValueError):
    """A manifest cannot be parsed; the checkpoint it describes is not served."""


def atomic_write(path: Path, data: bytes, mode: int = 0o440) -> None:
    """Replace `path` with `data` so a reader sees the old or the new file, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o660)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Persist a rename/unlink in `path` (a no-op cost on tmpfs, required on disks)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
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
        "node_id": record.node_id,
        "files": files,
    }


def from_json(doc: dict[str, Any]) -> CheckpointRecord:
    """Parse a manifest document; raises ManifestError naming what is wrong."""
    try:
        if doc["format"] != FORMAT_VERSION:
            raise ManifestError(f"unsupported manifest format {doc['format']!r}")
        record = CheckpointRecord(
            namespace=check_namespace(doc["namespace"]),
            checkpoint_id=check_checkpoint_id(doc["checkpoint_id"]),
            state=State(doc["state"]),
            created_unix=float(doc["created_unix"]),
            committed_unix=float(doc["committed_unix"]),
            sequence=int(doc["sequence"]),
            pinned=bool(doc["pinned"]),
            node_id=str(doc["node_id"]),
        )
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
    except ManifestError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"malformed manifest: {type(e).__name__}: {e}") from e
    return record


def write_manifest(path: Path, record: CheckpointRecord) -> None:
    atomic_write(path, json.dumps(to_json(record), indent=1).encode())


def read_manifest(path: Path) -> CheckpointRecord:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, json.JSONDecodeError) as e:
        raise ManifestError(f"cannot read manifest {path}: {e}") from e
    if not isinstance(doc, dict):
        raise ManifestError(f"manifest {path} is not a JSON object")
    return from_json(doc)
