"""A DCP checkpoint as torch before 2.2 wrote it: its `.metadata` names the legacy
``torch.distributed._shard.sharded_tensor.metadata.TensorProperties`` (and that
module's ``MEM_FORMAT_ENCODING``), which DCP still loads.

Written the way torch's own ``test_compatibility.py::test_sharded_tensor_dependency``
does: a stock ``dcp.save`` while DCP's ``TensorProperties`` is the legacy class, so the
bytes are what ``FileSystemWriter.finish`` pickles, not a hand-made imitation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor.metadata import (
    TensorProperties as LegacyTensorProperties,
)

from tests.support.dcp_files import SavedCheckpoint, make_state

__all__ = [
    "LEGACY_MODULE",
    "LegacyTensorProperties",
    "legacy_properties",
    "save_legacy_checkpoint",
]

LEGACY_MODULE = "torch.distributed._shard.sharded_tensor.metadata"


@contextmanager
def legacy_properties() -> Iterator[None]:
    """Within it, a stock ``dcp.save`` (to any storage writer) records legacy properties."""
    with patch("torch.distributed.checkpoint.metadata.TensorProperties", LegacyTensorProperties):
        yield


def save_legacy_checkpoint(directory: Path, state: dict[str, Any] | None = None) -> SavedCheckpoint:
    """A one-rank checkpoint in `directory` whose tensors' properties are legacy ones."""
    state = make_state() if state is None else state
    with legacy_properties():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)))
    raw = (directory / ".metadata").read_bytes()
    assert LEGACY_MODULE.encode() in raw and b"MEM_FORMAT_ENCODING" in raw
    return SavedCheckpoint(directory, state)
