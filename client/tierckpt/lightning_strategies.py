"""Lightning's sharded strategy over tierckpt: `TierModelParallelStrategy` (FSDP2, tensor
parallel).

Why a strategy and not only the plugin: Lightning 2.6's `ModelParallelStrategy` saves a
distributed checkpoint itself, every rank writing its shards
with ``dcp.save(checkpoint_id=Path(...))`` into a local folder, and never call the
`CheckpointIO` for it (nor for loading it). This subclass keeps everything else of its parent
and replaces only that: every rank saves its shards through `TieredStorageWriter`
in one collective DCP save, the non-tensor rest of Lightning's checkpoint (loops,
callbacks, hyper-parameters) rides along as one pickled bytes item that only this client
unpickles (as `TierCheckpointIO` saves it), and the global-zero rank writes the same
pointer file at the Lightning path that the plugin writes. So ``ModelCheckpoint`` retention,
``save_last`` and ``fit(ckpt_path="last")`` work as they do with the plugin, and a load
reshards through DCP like the parent's does.

Lightning's `FSDPStrategy` (FSDP1) is not covered: FSDP1 needs a non-CPU accelerator in
torch 2.13 (it cannot be tested on the CPU-only CI), and torch and Lightning point FSDP
users to FSDP2, i.e. `ModelParallelStrategy`. Its ``state_dict_type="full"`` saves would go
through `TierCheckpointIO`, but its loads read the local path directly.

Use: ``Trainer(strategy=TierModelParallelStrategy(...), plugins=[TierCheckpointIO("run7")])``;
the strategy takes its namespace, daemon and threads from the plugin. Only sharded
checkpoints are made: a full (rank-0, gathered) checkpoint is what the plain plugin is for
with a single-device or DDP strategy.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierckpt.fsspec_fs import LATEST
from tierckpt.lightning import (
    _REST_KEY,
    _TENSOR_KEY,
    POINTER_PREFIX,
    TierCheckpointIO,
    _is_url,
    _join,
    _RawBytesLoadPlanner,
    _split,
)
from tierckpt.storage_reader import TieredStorageReader
from tierckpt.storage_writer import TieredStorageWriter

__all__ = ["TierModelParallelStrategy"]


class _TieredShards:
    """What a sharded strategy needs beyond its parent: where a path's checkpoint lives,
    the collective save, the rest of the checkpoint, and the parts of a load that are not
    the model's."""

    if TYPE_CHECKING:  # the strategy's, which this mixes into
        checkpoint_io: Any
        global_rank: int

        def broadcast(self, obj: Any, src: int = 0) -> Any: ...
        def barrier(self, name: str | None = None) -> None: ...

    @property
    def _tier_io(self) -> TierCheckpointIO:
        io_ = self.checkpoint_io
        if not isinstance(io_, TierCheckpointIO):
            raise TypeError(
                f"{type(self).__name__} saves through tierckpt: pass "
                "Trainer(plugins=[TierCheckpointIO(NAMESPACE)]) (it names the namespace and "
                f"the daemon), not {type(io_).__name__}"
            )
        return io_

    def _target(self, filepath: str | os.PathLike[str]) -> tuple[str, str, str]:
        """(path, namespace, checkpoint id) of a save, the same on every rank."""
        path = str(self.broadcast(str(filepath)))
        tier = self._tier_io
        if _is_url(path):
            namespace, checkpoint_id = tier._parse(path)
        else:
            namespace, checkpoint_id = tier.namespace, tier._id_of(path)
        return path, namespace, checkpoint_id

    def _save_shards(self, state: dict[str, Any], path: str, namespace: str, ckpt: str) -> None:
        """One collective DCP save of every rank's shards; global zero adds the rest of
        the checkpoint and writes the pointer at `path`. A path saved before (``last.ckpt``)
        is replaced atomically when this save commits (`TieredStorageWriter` overwrite):
        until then the older checkpoint stays loadable."""
        tier = self._tier_io
        writer = TieredStorageWriter(
            namespace,
            daemon=tier.daemon,
            thread_count=tier.thread_count,
            durable=tier.durable,
            overwrite=True,
        )
        try:
            dcp_save(state, checkpoint_id=ckpt, storage_writer=writer)
        finally:
            writer.client.close()
        if self.global_rank == 0 and not _is_url(path):
            tier._write_pointer(Path(path), f"{POINTER_PREFIX}{namespace}/{ckpt}")
        self.barrier("tierckpt-saved")

    def _source(self, checkpoint_path: str | os.PathLike[str]) -> tuple[str, str] | None:
        """(namespace, id) a load reads, `latest` resolved once for every rank; None for a
        local checkpoint the parent strategy saved itself (a folder, a plain file)."""
        path = str(self.broadcast(str(checkpoint_path)))
        tier = self._tier_io
        if not _is_url(path) and (Path(path).is_dir() or not Path(path).is_file()):
            return None
        try:
            namespace, checkpoint_id = tier._resolve(path)
        except ValueError:
            return None
        if checkpoint_id == LATEST:
            reader = self._reader(namespace, None)
            try:
                reader.read_metadata()
                checkpoint_id = reader.checkpoint_id
            finally:
                reader.client.close()
        return namespace, checkpoint_id

    def _reader(self, namespace: str, checkpoint_id: str | None) -> TieredStorageReader:
        tier = self._tier_io
        reader = TieredStorageReader(namespace, daemon=tier.daemon, io_threads=tier.io_threads)
        reader.reset(checkpoint_id)
        return reader

    def _load(self, state: dict[str, Any], namespace: str, ckpt: str, **kwargs: Any) -> None:
        reader = self._reader(namespace, ckpt)
        try:
            dcp_load(state, checkpoint_id=ckpt, storage_reader=reader, **kwargs)
        finally:
            reader.client.close()

    def _load_rest(self, namespace: str, ckpt: str, weights_only: bool | None) -> dict[str, Any]:
        """The checkpoint minus its model and optimizer shards, as Lightning saved it."""
        reader = self._reader(namespace, ckpt)
        try:
            metadata = reader.read_metadata()
            state: dict[str, Any] = {}
            for key, item in metadata.state_dict_metadata.items():
                if key == _REST_KEY and isinstance(item, BytesStorageMetadata):
                    state[key] = io.BytesIO()
                elif key.startswith(_TENSOR_KEY) and not isinstance(item, BytesStorageMetadata):
                    state[key] = torch.empty(item.size, dtype=item.properties.dtype)
            if _REST_KEY not in state:
                raise ValueError(
                    f"{POINTER_PREFIX}{namespace}/{ckpt} holds no Lightning checkpoint rest: "
                    f"it was not saved by {type(self).__name__}"
                )
            dcp_load(
                state, checkpoint_id=ckpt, storage_reader=reader, planner=_RawBytesLoadPlanner()
            )
        finally:
            reader.client.close()
        return _join(state, weights_only is not False)


def _converted(checkpoint: dict[str, Any], model_key: str, rank: int) -> dict[str, Any]:
    """The parent's distributed state (model and optimizer shards under the parent's keys)
    plus, from global zero, the rest of the checkpoint."""
    state: dict[str, Any] = {model_key: checkpoint.pop("state_dict")}
    for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{index}"] = optimizer_state
    if rank == 0:
        state.update(_split(checkpoint))
    return state


class TierModelParallelStrategy(_TieredShards, ModelParallelStrategy):
    """`ModelParallelStrategy` (FSDP2, tensor parallel; DTensor shards) whose distributed
    checkpoints live in tierckpt's tiers. Takes the parent's arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is False:
            raise ValueError(
                "TierModelParallelStrategy saves sharded checkpoints only "
                "(save_distributed_checkpoint=True)"
            )
        super().__init__(*args, **kwargs)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        path, namespace, ckpt = self._target(filepath)
        state = _converted(checkpoint, "state_dict", self.global_rank)
        self._save_shards(state, path, namespace, ckpt)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        source = self._source(checkpoint_path)
        if source is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        namespace, ckpt = source
        assert self.model is not None and self.lightning_module is not None
        module = self.model
        module_state = {"state_dict": get_model_state_dict(module)}
        self._load(module_state, namespace, ckpt)
        module.load_state_dict(
            module_state["state_dict"], strict=self.lightning_module.strict_loading
        )
        options = StateDictOptions(cpu_offload=True)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
            self._load(optimizer_state, namespace, ckpt)
            set_optimizer_state_dict(
                module, optimizer, optim_state_dict=optimizer_state[key], options=options
            )
        return self._load_rest(namespace, ckpt, weights_only)
