"""The SageMaker client's S3 layout, re-created for tests, and its README example as a job.

`SeedLayoutWriter` reproduces ``amzn-sagemaker-checkpointing`` 1.1.3's writer byte for
byte (``checkpointing/filesystem/writer.py``): per rank one ``BytesIO`` of the rank's
items back to back (raw bytes for BYTE_IO, ``torch.save`` of the detached contiguous CPU
tensor otherwise), each recorded as ``_SageMakerStorageInfo(rank, offset, length)``,
uploaded to ``<base>/<ns>/rank_R/step_N/checkpoint.pt``; the coordinator pickles the
`Metadata` (``pickle.HIGHEST_PROTOCOL``) to ``rank_R/step_N/metadata.metadata``. The
storage-info class is pickled under the seed's module path through a throwaway module
that is removed again, so the importer under test cannot rely on it.

`readme_example` is the seed's README "Complete Distributed Training Example" (DDP +
AdamW + StepLR, in-memory every `memory_freq` steps, ``save_to_s3`` every `s3_freq`),
with only its import line changed to `tierckpt.compat.sagemaker`, on gloo CPU ranks (the
gradient all-reduce on a group of its own, standing in for the README's NCCL).
"""

from __future__ import annotations

import copy
import io
import pickle
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

SEED_MODULE = "amzn_sagemaker_checkpointing.checkpointing.filesystem.storage_info"


@dataclass
class _SageMakerStorageInfo:
    rank: int
    offset: int
    length: int


def _pickle_as_seed(metadata: Metadata) -> bytes:
    """Pickle `metadata` with its storage infos under the seed's module path."""
    saved = (_SageMakerStorageInfo.__module__, _SageMakerStorageInfo.__qualname__)
    parts = SEED_MODULE.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    for name in names:  # pickle imports the module (and so its parent packages)
        sys.modules[name] = types.ModuleType(name)
    sys.modules[SEED_MODULE]._SageMakerStorageInfo = _SageMakerStorageInfo  # type: ignore[attr-defined]
    _SageMakerStorageInfo.__module__ = SEED_MODULE
    try:
        return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        _SageMakerStorageInfo.__module__ = saved[0]
        for name in names:
            del sys.modules[name]


class SeedLayoutWriter(StorageWriter):
    """The seed's writer for one rank of one step, writing to an fsspec filesystem.

    `rank` overrides DCP's rank so a single process can write every rank of a
    multi-rank layout (each rank's state saved on its own, the metadata merged).
    """

    def __init__(self, fs: Any, base: str, namespace: str, step: int, rank: int) -> None:
        super().__init__()
        self.fs, self.base, self.ns, self.step, self.rank = fs, base, namespace, step, rank
        self.metadata: Metadata | None = None

    def _uri(self, rank: int, name: str) -> str:
        return f"{self.base}/{self.ns}/rank_{rank}/step_{self.step}/{name}"  # get_s3_uri

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        buffer = io.BytesIO()
        results = []
        for item in plan.items:
            offset = buffer.tell()
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                buffer.write(data.getbuffer())
            else:
                torch.save(data.detach().contiguous().cpu(), buffer)
            length = buffer.tell() - offset
            info = _SageMakerStorageInfo(rank=self.rank, offset=offset, length=length)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
        self.fs.pipe_file(self._uri(self.rank, "checkpoint.pt"), buffer.getvalue())
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = StorageMeta()
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta()


def seed_save(fs: Any, base: str, ns: str, step: int, per_rank: list[dict[str, Any]]) -> None:
    """Write one step in the seed's layout: rank R's state is `per_rank[R]` (disjoint keys);
    rank 0 uploads the merged `metadata.metadata`, as the coordinator does."""
    import torch.distributed.checkpoint as dcp

    merged: Metadata | None = None
    for rank, state in enumerate(per_rank):
        writer = SeedLayoutWriter(fs, base, ns, step, rank)
        dcp.save(copy.deepcopy(state), storage_writer=writer, no_dist=True)
        md = writer.metadata
        assert md is not None
        if merged is None:
            merged = md
        else:
            merged.state_dict_metadata.update(md.state_dict_metadata)
            assert merged.storage_data is not None
            merged.storage_data.update(md.storage_data)
    assert merged is not None
    path = f"{base}/{ns}/rank_0/step_{step}/metadata.metadata"
    fs.pipe_file(path, _pickle_as_seed(merged))


# ---- the seed's README example, import line changed ---------------------------------------


def readme_example(
    ctx: Any, s3_base: str, namespace: str, steps: int, freqs: tuple[int, int]
) -> Any:
    """Train, save like the README (async_save, new writer per step, save_to_s3 every
    `s3_freq`), then restore the newest with ``step=None`` into a fresh model; returns
    (the step restored, whether it is bit-exact with what was saved at that step)."""
    import torch.distributed as dist

    # The one changed line: was `from amzn_sagemaker_checkpointing... import ...`.
    from tierckpt.compat.sagemaker import (
        SageMakerCheckpointConfig,
        SageMakerTieredStorageReader,
        SageMakerTieredStorageWriter,
    )
    from torch import nn
    from torch.distributed.checkpoint import async_save, load
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(1234)

    # The README trains on NCCL (device collectives) while async_save's thread runs DCP's
    # collectives on the default group; on gloo CPU ranks the gradient all-reduce gets a
    # group of its own to stand in for NCCL, or the two threads would interleave
    # collectives on one group. The checkpoint calls are the README's, unchanged.
    grad_group = dist.new_group(backend="gloo")

    def create_model() -> nn.Module:
        return DDP(nn.Linear(1000, 10), process_group=grad_group)

    model = create_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.9)
    checkpoint_config = SageMakerCheckpointConfig(
        namespace=namespace, world_size=dist.get_world_size(), s3_tier_base_path=s3_base
    )
    in_memory_ckpt_freq, s3_ckpt_freq = freqs
    future = None
    saved: dict[int, Any] = {}
    s3_steps = []
    for step in range(steps):
        optimizer.zero_grad()
        inputs = torch.randn(32, 1000)
        targets = torch.randint(0, 10, (32,))
        loss = nn.CrossEntropyLoss()(model(inputs), targets)
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        if step % in_memory_ckpt_freq == 0 or step % s3_ckpt_freq == 0:
            state_dict = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "step": step,
            }
            checkpoint_config.save_to_s3 = step % s3_ckpt_freq == 0
            if checkpoint_config.save_to_s3:
                s3_steps.append(step)
            storage_writer = SageMakerTieredStorageWriter(
                checkpoint_config=checkpoint_config, step=step
            )
            if future is not None:
                exc = future.exception()
                if exc:
                    raise RuntimeError(f"Failure in saving previous checkpoint: {exc}") from exc
                future.result()
            future = async_save(state_dict=state_dict, storage_writer=storage_writer)
            saved[step] = copy.deepcopy(state_dict)
    assert future is not None
    future.result()

    # Resume, as the README does, into a fresh model.
    torch.manual_seed(999)
    model = create_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # create the optimizer's state so that DCP loads into it
        p.grad = torch.zeros_like(p)
    optimizer.step()
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.9)
    state_dict = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": lr_scheduler.state_dict(),
        "step": 0,
    }
    storage_reader = SageMakerTieredStorageReader(checkpoint_config=checkpoint_config)
    load(state_dict, storage_reader=storage_reader)
    restored = int(state_dict["step"])
    return restored, _equal(state_dict, saved[restored]), s3_steps


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
