"""Lightning's `CheckpointIO` over tierckpt: ``Trainer(plugins=[TierCheckpointIO("run7")])``.

Why a plugin: Lightning 2.6 hands its checkpoint IO a local path (and its strategies turn
paths into `pathlib.Path`), so a ``tierckpt://`` URL never reaches DCP. The plugin saves
what Lightning would ``torch.save`` as one DCP checkpoint through `TieredStorageWriter`:
every plain tensor is a DCP tensor (the daemon stores, replicates and drains it like any
other), and the rest of the dict (step, epoch, loops, callbacks, hyper-parameters) is one
pickled DCP bytes item that only this client ever unpickles; the daemon never does.

Paths. A Lightning path's file name is the checkpoint id in the plugin's namespace
(``.../checkpoints/epoch=0-step=10.ckpt`` -> ``tierckpt://NS/epoch=0-step=10.ckpt``), and
after the commit the plugin writes a small *pointer file* at the path whose only line is
that URL. Lightning keeps doing everything it does with local files (``ckpt_path="last"``
lists the folder, ``ModelCheckpoint`` checks existence, ``save_last="link"`` symlinks),
while the bytes live in the tiers. ``remove_checkpoint`` removes the pointer, then the
checkpoint from every tier (``tierckpt rm``), so ``ModelCheckpoint(save_top_k=k)``
retention applies to the tiers. ``ckpt_path`` may also be a URL,
``tierckpt://NS/last.ckpt`` or ``tierckpt://NS/latest``: how a job resumes on a node whose
pointer files were lost.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch import _weights_only_unpickler  # the unpickler torch.load(weights_only=True) uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import CheckpointNotFound, InvalidName
from tierckpt.fsspec_fs import LATEST, PROTOCOL, parse_path
from tierckpt.names import check_namespace, check_new_checkpoint_id
from tierckpt.storage_reader import TieredStorageReader
from tierckpt.storage_writer import TieredStorageWriter

__all__ = ["POINTER_PREFIX", "TierCheckpointIO"]

logger = logging.getLogger(__name__)

POINTER_PREFIX = f"{PROTOCOL}://"
_POINTER_MAX = 4096  # a pointer is one URL line; anything longer is not one
# The DCP keys of a saved Lightning checkpoint: the pickled rest, and one key per tensor.
_REST_KEY = "lightning.rest"
_TENSOR_KEY = "lightning.tensor."
_PICKLE_PROTOCOL = 2  # torch.save's: what torch's weights-only unpickler reads


class _TensorPickler(pickle.Pickler):
    """Pickles a checkpoint dict with its plain tensors left out as numbered references,
    the way `torch.save` leaves out storages; each tensor object is referenced once."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        # Subclasses (Parameter, DTensor) and sparse or meta tensors stay pickled in the
        # rest: DCP's plain-tensor path would drop their type or cannot hold them.
        if type(obj) is not torch.Tensor or obj.layout != torch.strided or obj.is_meta:
            return None
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index


def _split(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The DCP state dict of a Lightning checkpoint: its tensors and the pickled rest."""
    buffer = io.BytesIO()
    pickler = _TensorPickler(buffer)
    pickler.dump(checkpoint)
    # DCP `torch.save`s a bytes item's object: a `bytes` comes back through weights-only
    # `torch.load` whatever the rest holds.
    state: dict[str, Any] = {_REST_KEY: buffer.getvalue()}
    for index, tensor in enumerate(pickler.tensors):
        state[f"{_TENSOR_KEY}{index}"] = tensor.detach()
    return state


def _tensor_of(tensors: dict[int, torch.Tensor], pid: Any) -> torch.Tensor:
    if type(pid) is not int or pid not in tensors:
        raise pickle.UnpicklingError(f"checkpoint references tensor {pid!r}, which it lacks")
    return tensors[pid]


class _TensorUnpickler(pickle.Unpickler):
    """pickle's unpickler with `_TensorPickler`'s references resolved (weights_only=False)."""

    def __init__(self, file: io.BytesIO, tensors: dict[int, torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return _tensor_of(self.tensors, pid)


class _WeightsOnlyTensorUnpickler(_weights_only_unpickler.Unpickler):
    """What `torch.load(weights_only=True)` unpickles with, `_TensorPickler`'s references
    resolved; torch's allow-list (`torch.serialization.add_safe_globals`) applies."""

    def __init__(self, file: io.BytesIO, tensors: dict[int, torch.Tensor]) -> None:
        super().__init__(file, encoding="utf-8")
        self.tensors = tensors

    def load(self) -> Any:
        return super().load()  # type: ignore[no-untyped-call]

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return _tensor_of(self.tensors, pid)


def _join(state: dict[str, Any], weights_only: bool) -> dict[str, Any]:
    """The Lightning checkpoint `_split` saved, its tensors put back in place."""
    rest = state[_REST_KEY]
    if not isinstance(rest, bytes):
        raise ValueError(
            f"checkpoint item {_REST_KEY!r} is not bytes: not saved by TierCheckpointIO"
        )
    tensors: dict[int, torch.Tensor] = {
        int(key[len(_TENSOR_KEY) :]): value
        for key, value in state.items()
        if key.startswith(_TENSOR_KEY)
    }
    kind = _WeightsOnlyTensorUnpickler if weights_only else _TensorUnpickler
    loaded = kind(io.BytesIO(rest), tensors).load()
    if not isinstance(loaded, dict):
        raise ValueError(f"checkpoint holds a {type(loaded).__name__}, not a Lightning dict")
    return loaded


class _RawBytesLoadPlanner(DefaultLoadPlanner):
    """Loads bytes items with weights-only `torch.load` (they hold `bytes`): DCP's own
    planner loads them with weights_only=False, whatever Lightning asked for."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        value.seek(0)
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _is_url(path: str | os.PathLike[str]) -> bool:
    return isinstance(path, str) and path.startswith(POINTER_PREFIX)


def _read_pointer(path: Path) -> str | None:
    """The URL a pointer file holds, or None when `path` is some other file."""
    with path.open("rb") as f:
        head = f.read(_POINTER_MAX + 1)
    text = head.decode("utf-8", "replace").strip()
    if len(head) > _POINTER_MAX or not text.startswith(POINTER_PREFIX) or "\n" in text:
        return None
    return text


class TierCheckpointIO(CheckpointIO):
    """Saves, loads and removes Lightning checkpoints in tierckpt's tiers.

    Args:
        namespace: the training job's namespace; a path's file name is the checkpoint id
            in it, so give each run (each ``ModelCheckpoint`` folder) its own namespace.
        daemon: the local daemon's address; default ``$TIERCKPT_DAEMON``, else the
            default unix socket.
        durable: ask the daemon to drain every checkpoint this plugin saves to the
            persistent tier (`TieredStorageWriter`'s ``durable``).
        thread_count: writer threads (and files) per save.
        io_threads: reader threads per load.

    Use it with a local ``ModelCheckpoint`` folder; the folder holds pointer files only:
    ``Trainer(plugins=[TierCheckpointIO("run7")], callbacks=[ModelCheckpoint(dirpath=...,
    save_last=True)])`` and ``trainer.fit(model, ckpt_path="last")``. Saving a file name
    that exists (``last.ckpt`` every time) replaces that checkpoint atomically, as
    ``torch.save`` over a local file would, but with no window: the new one is a new
    generation that retires the old one only when it commits, so a crash mid-save leaves
    ``last.ckpt`` naming the previous checkpoint, whole. Only the global-zero rank saves
    (Lightning's strategies call it there), so the save runs DCP without collectives;
    every rank may load.
    """

    def __init__(
        self,
        namespace: str,
        *,
        daemon: str | None = None,
        durable: bool = False,
        thread_count: int = 2,
        io_threads: int = 4,
    ) -> None:
        super().__init__()
        self.namespace = check_namespace(namespace)
        self.daemon = daemon
        self.durable = durable
        self.thread_count = thread_count
        self.io_threads = io_threads
        self._client: DaemonClient | None = None

    # --- paths -------------------------------------------------------------------------
    def url(self, path: str | os.PathLike[str]) -> str:
        """The ``tierckpt://`` URL a Lightning path names (what its pointer file says)."""
        return f"{POINTER_PREFIX}{'/'.join(self._resolve(path))}"

    def _resolve(self, path: str | os.PathLike[str]) -> tuple[str, str]:
        """(namespace, checkpoint id) of a URL, of the pointer file at a path, or else of
        the path's file name in this plugin's namespace."""
        if _is_url(path):
            return self._parse(str(path))
        local = Path(path)
        if local.is_file():
            pointer = _read_pointer(local)
            if pointer is not None:
                return self._parse(pointer)
        return self.namespace, self._id_of(path)

    @staticmethod
    def _parse(url: str) -> tuple[str, str]:
        parsed = parse_path(url)
        if parsed.depth < 2:
            raise InvalidName(
                f"{url[:200]!r} names no checkpoint: use {POINTER_PREFIX}NAMESPACE/CHECKPOINT_ID"
            )
        return parsed.namespace, parsed.checkpoint_id

    @property
    def client(self) -> DaemonClient:
        if self._client is None:
            self._client = DaemonClient(self.daemon)
        return self._client

    # --- CheckpointIO ----------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Save `checkpoint` as a DCP checkpoint in the tiers, then the pointer at `path`."""
        if storage_options is not None:
            raise TypeError(
                "TierCheckpointIO takes no storage_options: set durable=... on the plugin"
            )
        if _is_url(path):
            namespace, checkpoint_id = self._parse(str(path))
        else:
            namespace, checkpoint_id = self.namespace, self._id_of(path)
        self._save(_split(checkpoint), namespace, checkpoint_id)
        if not _is_url(path):
            self._write_pointer(Path(path), f"{POINTER_PREFIX}{namespace}/{checkpoint_id}")

    def _id_of(self, path: str | os.PathLike[str]) -> str:
        """The checkpoint id a local path's file name is (validated)."""
        name = Path(path).name
        try:
            return check_new_checkpoint_id(name)
        except InvalidName as e:
            raise InvalidName(
                f"Lightning checkpoint path {str(path)[:200]!r}: its file name becomes the "
                f"tierckpt checkpoint id in namespace {self.namespace!r}: {e}"
            ) from e

    def _save(self, state: dict[str, Any], namespace: str, checkpoint_id: str) -> None:
        """Save `state`; a committed id is replaced when this save commits (overwrite)."""
        writer = TieredStorageWriter(
            namespace,
            daemon=self.daemon,
            thread_count=self.thread_count,
            durable=self.durable,
            overwrite=True,
        )
        try:
            dcp_save(state, checkpoint_id=checkpoint_id, storage_writer=writer, no_dist=True)
        finally:
            writer.client.close()

    @staticmethod
    def _write_pointer(path: Path, url: str) -> None:
        """The pointer file, replaced atomically: Lightning never sees half a line."""
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        staged.write_text(url + "\n", encoding="utf-8")
        os.replace(staged, path)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load the checkpoint `path` names, bit-exact; tensors land on the CPU unless
        `map_location` is a device. A local file that is no pointer (a checkpoint saved
        before the plugin was added) is loaded the way Lightning's own IO loads it.

        `weights_only` is torch.load's: None or True unpickle the non-tensor part with
        torch's weights-only unpickler (torch's and Lightning's default), False with pickle.
        """
        if map_location is not None and not isinstance(map_location, str | torch.device):
            raise TypeError(
                f"TierCheckpointIO loads with map_location None, a device or a device name, "
                f"not {type(map_location).__name__}"
            )
        if not _is_url(path):
            local = Path(path)
            if local.is_file() and _read_pointer(local) is None:
                loaded = torch.load(local, map_location=map_location, weights_only=weights_only)
                if not isinstance(loaded, dict):
                    raise ValueError(f"{str(path)[:200]!r} holds no Lightning checkpoint dict")
                return loaded
        namespace, checkpoint_id = self._resolve(path)
        reader = TieredStorageReader(namespace, daemon=self.daemon, io_threads=self.io_threads)
        try:
            reader.reset(None if checkpoint_id == LATEST else checkpoint_id)
            metadata = reader.read_metadata()
            checkpoint_id = reader.checkpoint_id  # `latest` resolved once, for the load
            state: dict[str, Any] = {}
            for key, item in metadata.state_dict_metadata.items():
                if isinstance(item, TensorStorageMetadata):
                    state[key] = torch.empty(item.size, dtype=item.properties.dtype)
                elif isinstance(item, BytesStorageMetadata):
                    state[key] = io.BytesIO()
            if _REST_KEY not in state:
                raise ValueError(
                    f"{POINTER_PREFIX}{namespace}/{checkpoint_id} is a DCP checkpoint that "
                    "TierCheckpointIO did not save: load it with dcp.load"
                )
            dcp_load(
                state,
                checkpoint_id=checkpoint_id,
                storage_reader=reader,
                planner=_RawBytesLoadPlanner(),
                no_dist=True,
            )
        finally:
            reader.client.close()
        if map_location is not None:
            state = {
                k: v.to(map_location) if isinstance(v, torch.Tensor) else v
                for k, v in state.items()
            }
        return _join(state, weights_only is not False)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the pointer at `path`, then its checkpoint from every tier. A symlink
        (``save_last="link"``) is only unlinked: its target is another path's checkpoint."""
        if not _is_url(path):
            local = Path(path)
            if local.is_symlink():
                local.unlink()
                return
            if local.is_file() and _read_pointer(local) is None:
                local.unlink()  # a plain Lightning checkpoint file, not ours
                return
        namespace, checkpoint_id = self._resolve(path)
        if not _is_url(path):
            Path(path).unlink(missing_ok=True)
        self._delete(namespace, checkpoint_id)

    def _delete(self, namespace: str, checkpoint_id: str) -> None:
        try:
            self.client.delete_checkpoint(namespace, checkpoint_id)
        except CheckpointNotFound:
            logger.debug("%s/%s was already gone", namespace, checkpoint_id)

    def teardown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
