"""Where a rank saves and loads: the tiered store, or a stock DCP directory.

Both are small frozen dataclasses so they pickle into spawned ranks. `Directory` uses
stock `FileSystemWriter`/`FileSystemReader`; the tests use it to read what `tierckpt pull`
wrote, and it checks the harness itself against stock DCP.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch.distributed.checkpoint as dcp

__all__ = ["Backend", "Directory", "Nodes", "Tiered"]


@dataclasses.dataclass(frozen=True)
class Tiered:
    namespace: str
    address: str
    durable: bool = False  # commit with the "make this one durable" hint
    overwrite: bool = True  # False: a committed id is immutable (CheckpointExists)

    def writer(self) -> Any:
        from tierckpt import TieredStorageWriter

        return TieredStorageWriter(
            self.namespace, daemon=self.address, durable=self.durable, overwrite=self.overwrite
        )

    def reader(self) -> Any:
        from tierckpt import TieredStorageReader

        return TieredStorageReader(self.namespace, daemon=self.address)

    def save(self, state: dict[str, Any], checkpoint_id: str) -> None:
        dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=self.writer())

    def async_save(self, state: dict[str, Any], checkpoint_id: str, executor: str) -> Any:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
        return dcp.async_save(
            state,
            checkpoint_id=checkpoint_id,
            storage_writer=self.writer(),
            async_checkpointer_type=kind[executor],
        )

    def load(self, state: dict[str, Any], checkpoint_id: str | None) -> None:
        dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=self.reader())


@dataclasses.dataclass(frozen=True)
class Directory:
    root: str

    def writer(self) -> Any:
        raise NotImplementedError("stock writers take the path per save")

    def save(self, state: dict[str, Any], checkpoint_id: str) -> None:
        path = os.path.join(self.root, checkpoint_id)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))

    def async_save(self, state: dict[str, Any], checkpoint_id: str, executor: str) -> Any:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
        path = os.path.join(self.root, checkpoint_id)
        return dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(path),
            async_checkpointer_type=kind[executor],
        )

    def load(self, state: dict[str, Any], checkpoint_id: str | None) -> None:
        assert checkpoint_id is not None, "a stock directory has no 'newest'"
        path = os.path.join(self.root, checkpoint_id)
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Ranks spread over several nodes: rank r talks to the daemon of node r // ranks_per_node."""

    namespace: str
    addresses: tuple[str, ...]
    ranks_per_node: int
    durable: bool = False  # commit with the "make this one durable" hint

    def _tiered(self) -> Tiered:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        return Tiered(self.namespace, self.addresses[rank // self.ranks_per_node], self.durable)

    def writer(self) -> Any:
        return self._tiered().writer()

    def reader(self) -> Any:
        return self._tiered().reader()

    def save(self, state: dict[str, Any], checkpoint_id: str) -> None:
        self._tiered().save(state, checkpoint_id)

    def async_save(self, state: dict[str, Any], checkpoint_id: str, executor: str) -> Any:
        return self._tiered().async_save(state, checkpoint_id, executor)

    def load(self, state: dict[str, Any], checkpoint_id: str | None) -> None:
        self._tiered().load(state, checkpoint_id)


@dataclasses.dataclass(frozen=True)
class StockUrl:
    """Stock DCP loads from `<root>/<checkpoint id>` (any fsspec URL): no tierckpt at all."""

    root: str

    def load(self, state: dict[str, Any], checkpoint_id: str | None) -> None:
        assert checkpoint_id is not None, "a stock URL has no 'newest'"
        dcp.load(state, checkpoint_id=f"{self.root}/{checkpoint_id}")


Backend = Tiered | Directory | Nodes | StockUrl
