"""The `.metadata` of a large sharded save, built without a process group or a save:
the real shape that `FileSystemWriter.finish` pickles, at any size. The bytes are made
once per test session for each size (the 17.9 MB one takes seconds to build and pickle,
and both the decoder's bounds and the daemon's decoding child are checked against it)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from tierckpt.dcp_metadata import dump_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

__all__ = ["large_metadata", "large_metadata_bytes"]


def large_metadata(tensors: int, chunks: int) -> Metadata:
    """What a sharded save of `tensors` tensors in `chunks` chunks each writes (the
    shape FileSystemWriter.finish pickles), built without a process group."""
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for t in range(tensors):
        fqn = f"model.layers.{t // 10}.mlp.block{t % 10}.weight"
        parts = []
        for c in range(chunks):
            offsets = torch.Size([c * 16, 0])
            parts.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([16, 128])))
            storage[MetadataIndex(fqn, offsets, c)] = _StorageInfo(
                f"__{c}_0.distcp", t * 4096, 4096
            )
        sdm[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size([chunks * 16, 128]), parts
        )
    return Metadata(
        state_dict_metadata=sdm,
        planner_data={fqn: (fqn,) for fqn in sdm},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id="/ckpt/step-1", save_id="abc"),
    )


@functools.cache
def large_metadata_bytes(tensors: int, chunks: int) -> bytes:
    """`large_metadata(tensors, chunks)` pickled as DCP does, made once per session
    (bytes only: the decoded objects of the largest take about 230 MiB)."""
    return dump_metadata(large_metadata(tensors, chunks))
