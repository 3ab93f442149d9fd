"""The commit marker of a format-neutral ("files") checkpoint in the persistent tier.

A DCP checkpoint is committed by its `.metadata`, uploaded last. A checkpoint of any
other format has no file tierckpt may decode, so its commit is a bookkeeping object,
``<url>/.tierckpt/<ns>/<flat id>/files-commit.json``, PUT after every file is up: it
lists each file with its size and the fingerprint of its block checksums
(`markers.fingerprint`). The checkpoint's own directory holds exactly its files, in
the layout a local filesystem would have, so the format's own reader opens it.

The marker is read back from a bucket anyone may have written to, so `parse` trusts
nothing (sizes bounded, names validated, at most MAX_FILES entries), and adoption takes
a "files" manifest only when the marker lists the same files, sizes and checksums
(`check_matches`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tierckpt.names import check_checkpoint_id, check_file_name, check_namespace

from tierckptd.model import FileRecord
from tierckptd.persistent.markers import fingerprint

__all__ = ["FILES_COMMIT_OBJECT", "MAX_COMMIT", "FilesCommit", "check_matches", "parse"]

FILES_COMMIT_OBJECT = "files-commit.json"
MAX_COMMIT = 64 << 20  # bytes read of a marker at most (a tampered bucket)
_MAX_FILES = 1 << 20
_MAX_SIZE = (1 << 63) - 1


@dataclass(frozen=True)
class FilesCommit:
    """What the marker says: the checkpoint and, by name, (size, fingerprint)."""

    namespace: str
    checkpoint_id: str
    files: Mapping[str, tuple[int, str]]

    @classmethod
    def of(cls, namespace: str, checkpoint_id: str, files: Iterable[FileRecord]) -> FilesCommit:
        return cls(namespace, checkpoint_id, {f.name: (f.size, fingerprint(f)) for f in files})

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": "files",
                "namespace": self.namespace,
                "checkpoint_id": self.checkpoint_id,
                "files": [
                    {"name": n, "size": s, "fingerprint": fp}
                    for n, (s, fp) in sorted(self.files.items())
                ],
            },
            separators=(",", ":"),
        ).encode()


def parse(data: bytes) -> FilesCommit:
    """A marker read back from the store, validated field by field.

    Raises:
        ValueError: not a commit marker of a "files" checkpoint.
    """
    try:
        raw = json.loads(data)
        if raw["format"] != "files":
            raise ValueError("not a files commit marker")
        entries = raw["files"]
        if not isinstance(entries, list) or len(entries) > _MAX_FILES:
            raise ValueError(f"files is not a list of at most {_MAX_FILES} entries")
        files: dict[str, tuple[int, str]] = {}
        for e in entries:
            size = e["size"]
            if type(size) is not int or not 0 <= size <= _MAX_SIZE:
                raise ValueError(f"size {str(size)[:32]!r} is not an int in 0..2**63-1")
            fp = e["fingerprint"]
            if not isinstance(fp, str) or len(fp) > 256:
                raise ValueError("a fingerprint is not a string of at most 256 characters")
            files[check_file_name(e["name"])] = (size, fp)
        return FilesCommit(
            check_namespace(raw["namespace"]), check_checkpoint_id(raw["checkpoint_id"]), files
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # InvalidName too
        raise ValueError(
            f"not a valid files commit marker: {type(e).__name__}: {str(e)[:160]}"
        ) from None


def check_matches(
    marker: FilesCommit, namespace: str, checkpoint_id: str, files: Iterable[FileRecord]
) -> None:
    """Refuse (ValueError) a marker that does not describe exactly these files."""
    if (marker.namespace, marker.checkpoint_id) != (namespace, checkpoint_id):
        raise ValueError(
            f"the files commit marker of {namespace}/{checkpoint_id} describes "
            f"{marker.namespace}/{marker.checkpoint_id}"
        )
    expected = FilesCommit.of(namespace, checkpoint_id, files).files
    if dict(marker.files) != dict(expected):
        differ = sorted(set(marker.files) ^ set(expected)) or sorted(
            n for n in expected if marker.files.get(n) != expected[n]
        )
        raise ValueError(
            f"the files commit marker of {namespace}/{checkpoint_id} does not match its "
            f"manifest: {', '.join(differ[:5])}"
        )
