"""Staging buffers for `dcp.async_save` that belong to the process, not to a writer.

`async_save` blocks the training loop for exactly one thing: copying the state into host
memory that training will not touch while the upload runs. Allocating that memory is the
expensive part (fresh memory is page-faulted in on first write: 0.15-0.4 s per GiB here,
against 0.07-0.09 s to copy into touched pages), and most training code builds
a new `TieredStorageWriter` per save. So the buffers live here, in a per-process registry
keyed by namespace and the state dict's *layout* (keys, and each tensor's dtype, shape,
stride and device, DTensor/ShardedTensor placement included): any writer staging the same
layout for the same namespace copies into the same buffers.

A CPU state's buffers start as private memory: the first `async_save` of a job blocks
for their allocation, and private pages fault in about twice as fast as shared-memory
ones (1 GiB: 0.21-0.26 s for the whole first stage, against 0.45 s into fresh shared
memory). `AsyncCheckpointerType.THREAD` never needs them shared. The PROCESS executor's
first hand-off pickles them with torch's ForkingPickler, which moves each storage into
shared memory in place, in DCP's background thread, off the blocking path; from then on
the same (now shared) buffers are reused and every hand-off is a handle, not the bytes.
When any tensor of the state is on a CUDA device, the buffers are shared and page-locked
(pinned) from the start (a move would drop the pinning), and the device-to-host copies
run non-blocking on a side stream, synchronized before `stage()` returns (a staging
Future would turn `async_save`'s return value into an `AsyncSaveResponse` behind the
user's back).

Safety beyond DCP's rule (wait for the previous `async_save` before the next one): a buffer
set is in use from the start of its copy until the staged dict `stage()` returned is gone.
DCP holds that dict for the whole save with both executors (THREAD: the upload thread's
frame; PROCESS: the parent's frame waiting for the child's answer; a failed save's
traceback keeps it too), so its lifetime is a signal the parent process owns even when the
save itself runs in a child. A stage that finds every set of its layout in use allocates
another set rather than overwrite one (double-buffering on demand); idle extra sets are
freed on the next stage, so a namespace settles back to one set.

Released when a namespace stages a new layout (the old sets are dropped; an in-flight save
keeps its own alive until it ends) or by `release_staging()`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Hashable
from typing import Any, cast

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["StagingStats", "release_staging", "stage_state_dict", "staging_stats"]

# A save that just resolved its Future may still be unwinding in DCP's executor thread,
# which drops the staged dict a moment later: look again this often before allocating.
_BUSY_RETRIES = 3
_BUSY_RETRY_S = 0.001


class _StagedStateDict(dict[str, Any]):
    """The dict `stage()` returns; while it is alive, its buffer set is in use."""

    __slots__ = ("__weakref__",)

    def __reduce__(self) -> tuple[Any, ...]:
        # The PROCESS executor's child gets a plain dict: it needs no part of this module.
        return (dict, (), None, None, iter(self.items()))


@dataclasses.dataclass(frozen=True)
class StagingStats:
    """What the registry holds and has done since the process started (or forked)."""

    namespaces: int
    buffer_sets: int
    bytes: int
    allocations: int
    reuses: int


@dataclasses.dataclass(eq=False)
class _BufferSet:
    buffers: dict[str, Any]
    nbytes: int
    copying: bool = False
    staged: weakref.ref[_StagedStateDict] | None = None

    def busy(self) -> bool:
        return self.copying or (self.staged is not None and self.staged() is not None)


@dataclasses.dataclass(eq=False)
class _Slot:
    layout: Hashable
    sets: list[_BufferSet]


def _tensor_signature(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _layout(obj: Any, cuda: set[torch.device]) -> Hashable:
    """A hashable description of everything that decides the staging buffers.

    Non-tensor leaves count only as "a leaf": `_copy_state_dict` takes them from the state
    being staged every time (immutable ones by reference, other objects deep-copied), so
    their values and types may change between saves without new buffers.
    """
    if isinstance(obj, DTensor):
        local = obj._local_tensor
        if local.is_cuda:
            cuda.add(local.device)
        mesh = obj.device_mesh
        return (
            "dtensor",
            _tensor_signature(local),
            tuple(obj.shape),
            tuple(obj.stride()),
            tuple(str(p) for p in obj.placements),
            mesh.device_type,
            tuple(mesh.mesh.flatten().tolist()),
            mesh.mesh_dim_names,
        )
    if isinstance(obj, ShardedTensor):
        shards = [s.tensor for s in obj.local_shards()]
        cuda.update(t.device for t in shards if t.is_cuda)
        return ("sharded", repr(obj.metadata()), tuple(_tensor_signature(t) for t in shards))
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            cuda.add(obj.device)
        return ("tensor", *_tensor_signature(obj))
    if isinstance(obj, dict):
        return ("dict", tuple((key, _layout(value, cuda)) for key, value in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_layout(value, cuda) for value in obj))
    return "leaf"


def _nbytes(obj: Any) -> int:
    if isinstance(obj, DTensor):
        return _nbytes(obj._local_tensor)
    if isinstance(obj, ShardedTensor):
        return sum(_nbytes(s.tensor) for s in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


@torch.no_grad()
def _own_buffers(buffers: Any, source: Any, *, shared: bool) -> Any:
    """Fix what `_create_cpu_state_dict` leaves short of "buffers of our own".

    It returns a 0-d DTensor itself, not a copy (the "staged" value would be the live
    training tensor); with `shared`, it leaves 0-d tensors in private memory, which a
    PROCESS hand-off would move (pinned buffers must not move: all are shared here).
    """
    if buffers is source and isinstance(source, torch.Tensor):
        return copy.deepcopy(source.detach())
    if isinstance(buffers, dict):
        for key in buffers:
            buffers[key] = _own_buffers(buffers[key], source[key], shared=shared)
    elif isinstance(buffers, list):
        buffers[:] = [
            _own_buffers(b, s, shared=shared) for b, s in zip(buffers, source, strict=True)
        ]
    elif isinstance(buffers, tuple):
        return tuple(
            _own_buffers(b, s, shared=shared) for b, s in zip(buffers, source, strict=True)
        )
    elif shared and type(buffers) is torch.Tensor and buffers.device.type == "cpu":
        buffers.share_memory_()  # type: ignore[no-untyped-call]  # no-op when already shared
    return buffers


def _allocate(state_dict: dict[str, Any], pin: bool) -> dict[str, Any]:
    """New buffers for `state_dict`: pinned shared memory for a CUDA state, else private
    memory (faster to fault in; a PROCESS hand-off moves it into shared memory once)."""
    buffers = _create_cpu_state_dict(state_dict, pin_memory=pin, share_memory=pin)
    return cast(dict[str, Any], _own_buffers(buffers, state_dict, shared=pin))


_side_streams: dict[torch.device, Any] = {}


@torch.no_grad()
def _copy_into(
    state_dict: dict[str, Any], buffers: dict[str, Any], cuda: set[torch.device]
) -> dict[str, Any]:
    """One copy of every tensor into `buffers`; device tensors land before this returns.

    `no_grad`: copying a parameter that requires grad would otherwise give the staged
    tensor a grad_fn, which the PROCESS executor cannot pickle.
    """
    if len(cuda) != 1:  # CPU only, or several devices: plain (synchronous) copies
        return _copy_state_dict(state_dict, buffers, type_check=False)
    (device,) = cuda
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams.setdefault(device, torch.cuda.Stream(device))  # type: ignore[no-untyped-call]
    # The side stream must see what the compute stream wrote to the state so far.
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        staged = _copy_state_dict(state_dict, buffers, non_blocking=True, type_check=False)
    stream.synchronize()
    return staged


class _Registry:
    """Namespace -> buffer sets of its current layout; every method is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._allocations = 0
        self._reuses = 0

    def _claim_idle(self, namespace: str, layout: Hashable) -> _BufferSet | None:
        """Under the lock: a set of this layout marked `copying`, or None (then allocate).

        A new layout replaces the namespace's sets; idle sets beyond the claimed one go.
        """
        slot = self._slots.get(namespace)
        if slot is None or slot.layout != layout:
            self._slots[namespace] = _Slot(layout, [])
            return None
        idle = [s for s in slot.sets if not s.busy()]
        if not idle:
            return None
        chosen = idle[0]
        slot.sets = [s for s in slot.sets if s is chosen or s.busy()]
        chosen.copying = True
        self._reuses += 1
        return chosen

    def stage(self, namespace: str, state_dict: dict[str, Any]) -> dict[str, Any]:
        cuda: set[torch.device] = set()
        layout = _layout(state_dict, cuda)
        chosen: _BufferSet | None = None
        for attempt in range(_BUSY_RETRIES + 1):
            with self._lock:
                chosen = self._claim_idle(namespace, layout)
                slot = self._slots[namespace]
                if chosen is not None or not slot.sets or attempt == _BUSY_RETRIES:
                    break
            time.sleep(_BUSY_RETRY_S)  # every set in use: maybe a save that is just ending
        if chosen is None:
            buffers = _allocate(state_dict, pin=bool(cuda))
            chosen = _BufferSet(buffers, _nbytes(buffers), copying=True)
            with self._lock:
                self._allocations += 1
                current = self._slots.get(namespace)
                if current is not None and current.layout == layout:
                    current.sets.append(chosen)
                # else another thread staged a new layout meanwhile: use this set once, unkept
        try:
            staged = _StagedStateDict(_copy_into(state_dict, chosen.buffers, cuda))
        except BaseException:
            with self._lock:
                chosen.copying = False
            raise
        with self._lock:
            chosen.staged = weakref.ref(staged)
            chosen.copying = False
        return staged

    def release(self, namespace: str | None) -> int:
        with self._lock:
            names = list(self._slots) if namespace is None else [namespace]
            dropped = [self._slots.pop(n) for n in names if n in self._slots]
        return sum(s.nbytes for slot in dropped for s in slot.sets)

    def stats(self) -> StagingStats:
        with self._lock:
            sets = [s for slot in self._slots.values() for s in slot.sets]
            return StagingStats(
                namespaces=len(self._slots),
                buffer_sets=len(sets),
                bytes=sum(s.nbytes for s in sets),
                allocations=self._allocations,
                reuses=self._reuses,
            )

    def reset_after_fork(self) -> None:
        """A forked child must never stage into its parent's shared buffers."""
        self._lock = threading.Lock()
        self._slots = {}
        self._allocations = self._reuses = 0
        _side_streams.clear()


_REGISTRY = _Registry()
os.register_at_fork(after_in_child=_REGISTRY.reset_after_fork)


def stage_state_dict(namespace: str, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Copy `state_dict` into this process's staging buffers for `namespace` and its layout.

    Returns the staged state (same structure; tensors are the staging buffers,
    non-tensor leaves taken from `state_dict`). The buffers stay in use, and are never
    handed to another stage, while the returned dict is referenced.
    """
    return _REGISTRY.stage(namespace, state_dict)


def release_staging(namespace: str | None = None) -> int:
    """Drop the staging buffers of `namespace` (all namespaces: None); returns their bytes.

    Memory is freed once no in-flight save still holds the buffers. The next async_save
    allocates afresh.
    """
    return _REGISTRY.release(namespace)


def staging_stats() -> StagingStats:
    """Namespaces, buffer sets and bytes held, and allocations/reuses so far."""
    return _REGISTRY.stats()
