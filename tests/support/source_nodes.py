"""In-process memory tiers for the tier conformance suite (tests/conformance/).

`MemoryNode` is one node's memory tier (a `Catalog` on its own directory) that saves
files the way a rank does (Begin, Reserve, Open, write, CommitFile, Commit), so what it
holds was committed and sealed by the real code. `flip_byte` damages a stored copy in
place (the bit rot a source must not hand out as good bytes).
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path

from tierckptd.catalog import Catalog
from tierckptd.memory.tier import MemoryTier
from tierckptd.model import FileRecord

from tests.support.catalog_files import write_file

__all__ = ["MemoryNode", "file_bytes", "flip_byte"]


def file_bytes(namespace: str, checkpoint_id: str, name: str, size: int) -> bytes:
    """Deterministic content of a test file (another checkpoint's file of the same name
    differs, so a source that mixes checkpoints up is caught)."""
    return random.Random(f"{namespace}/{checkpoint_id}/{name}").randbytes(size)


def flip_byte(path: str | Path, offset: int) -> None:
    """Invert one byte of a file in place (committed files are read-only: as their
    owner, or as root, the mode is lifted for the write and put back)."""
    st = os.stat(path)
    os.chmod(path, 0o600)
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            old = os.pread(fd, 1, offset)
            assert len(old) == 1, f"{path}: no byte at {offset}"
            os.pwrite(fd, bytes([old[0] ^ 0xFF]), offset)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.chmod(path, st.st_mode & 0o7777)


def write_in_place(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` into the file the daemon opened for a rank (short writes resumed)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view) :]
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


class MemoryNode:
    """One node's memory tier on `root`: a real `MemoryTier` and `Catalog`."""

    def __init__(
        self, root: Path, node_id: str, *, budget: int = 256 << 20, block_size: int = 64 << 10
    ) -> None:
        self.node_id = node_id
        self.block_size = block_size
        self.tier = MemoryTier(root)
        self.tier.open_layout()
        self.catalog = Catalog(
            self.tier,
            node_id=node_id,
            failure_domain=f"domain-{node_id}",
            budget=budget,
            memory_keep_last=0,  # keep every checkpoint: tests decide what goes
        )
        self.catalog.adopt()

    def save(
        self, namespace: str, checkpoint_id: str, files: Mapping[str, bytes], rank: int = 0
    ) -> dict[str, FileRecord]:
        """Save and commit `files` as one rank; returns the committed records."""
        catalog = self.catalog
        catalog.begin(namespace, checkpoint_id, rank)
        catalog.reserve(namespace, checkpoint_id, rank, sum(len(d) for d in files.values()))
        for name, data in files.items():
            write_file(
                catalog, namespace, checkpoint_id, name, data, rank, block_size=self.block_size
            )
        catalog.commit(namespace, checkpoint_id, list(files))
        return {name: self.catalog.file_view(namespace, checkpoint_id, name)[0] for name in files}

    def path_of(self, namespace: str, checkpoint_id: str, name: str) -> Path:
        """Where this node keeps its copy (it must hold one)."""
        _, path = self.catalog.file_view(namespace, checkpoint_id, name)
        assert path, f"node {self.node_id} holds no copy of {namespace}/{checkpoint_id}/{name}"
        return Path(path)

    def close(self) -> None:
        self.tier.close()
