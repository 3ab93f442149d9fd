"""The FileSource contract against a memory tier: another node's catalog and memory dir
in this process (a real save, sealed files), read through `MemorySource`."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from tierckptd.catalog import Catalog
from tierckptd.model import FileRecord
from tierckptd.restore import FileSource

from tests.conformance.file_source_contract import BLOCK, Backend, FileSourceContract
from tests.support.memory_source import MemorySource
from tests.support.source_nodes import MemoryNode, flip_byte


class MemoryBackend(Backend):
    def __init__(self, root: Path, node_id: str) -> None:
        self.root = root
        self.node = MemoryNode(root, node_id, block_size=BLOCK)

    def store(
        self, namespace: str, checkpoint_id: str, files: Mapping[str, bytes]
    ) -> dict[str, FileRecord]:
        return self.node.save(namespace, checkpoint_id, files)

    def source(self, catalog: Catalog) -> FileSource:
        return MemorySource(self.node.catalog)

    def corrupt_byte(self, namespace: str, checkpoint_id: str, name: str, offset: int) -> None:
        flip_byte(self.node.path_of(namespace, checkpoint_id, name), offset)

    def lose(self, namespace: str, checkpoint_id: str, name: str) -> None:
        os.unlink(self.node.path_of(namespace, checkpoint_id, name))

    def outage(self) -> None:
        # A memory dir the OS cannot resolve any more (ELOOP), not one that is empty.
        self.root.rename(self.root.with_name(self.root.name + ".down"))
        self.root.symlink_to(self.root.name)

    def restore_service(self) -> None:
        self.root.unlink()
        self.root.with_name(self.root.name + ".down").rename(self.root)

    def close(self) -> None:
        if self.root.is_symlink():
            self.restore_service()
        self.node.close()


class TestMemorySource(FileSourceContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[MemoryBackend]:
        b = MemoryBackend(tmp_path / "node-a", "node-a")
        yield b
        b.close()

    @pytest.fixture
    def other_backend(self, tmp_path: Path) -> Iterator[MemoryBackend]:
        b = MemoryBackend(tmp_path / "node-b", "node-b")
        yield b
        b.close()
