"""Process-owned async_save staging buffers (tierckpt.staging), without a daemon.

`TieredStorageWriter.stage()` never talks to the daemon, so these tests call it directly,
as `dcp.async_save` does, with real buffers (private, moved into shared memory by a PROCESS
hand-off's pickling, as in DCP's executor thread). Reuse is asserted by buffer
identity (data pointers) and the registry's counters, never by timing.
"""

from __future__ import annotations

import gc
import pickle
import threading
import weakref
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import tierckpt
import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers torch's ForkingPickler reductions)
from tierckpt import staging
from tierckpt.staging import release_staging, staging_stats
from tierckpt.storage_writer import TieredStorageWriter

ADDRESS = "unix:///tmp/x.sock"


@pytest.fixture(autouse=True)
def _empty_registry() -> Iterator[None]:
    staging._REGISTRY.reset_after_fork()  # no buffers, counters at zero
    yield
    release_staging()


def _writer(namespace: str = "ns") -> TieredStorageWriter:
    return TieredStorageWriter(namespace, daemon=ADDRESS)


def _state(seed: int = 0, n: int = 1000) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, generator=gen),
        "nested": {
            "b": torch.randn(3, 5, generator=gen).t(),  # non-contiguous source
            "half": torch.randn(7, generator=gen).to(torch.bfloat16),
            "count": seed,
            "name": f"run-{seed}",
            "tags": ["a", seed, torch.arange(4) + seed],
            "pair": (torch.full((2,), float(seed)), None),
        },
        "step": torch.tensor(float(seed)),  # 0-d, as AdamW's step
        "empty": torch.empty(0),
    }


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _pointers(staged: dict[str, Any]) -> list[int]:
    return [t.data_ptr() for t in _tensors(staged) if t.numel()]


def _assert_same(actual: Any, expected: Any, path: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.device.type == "cpu", path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual, expected.cpu()), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for key in expected:
            _assert_same(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, path


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return pickle.loads(pickle.dumps(state))


# --- reuse ------------------------------------------------------------------------------------
def test_new_writers_copy_into_the_same_buffers() -> None:
    state = _state(1)
    first = _writer().stage(state)
    _assert_same(first, state)
    pointers = _pointers(first)
    del first
    for seed in (2, 3):
        state = _state(seed)  # same layout, new values: as the next training step
        staged = _writer().stage(state)
        assert _pointers(staged) == pointers
        _assert_same(staged, state)
        del staged
    stats = staging_stats()
    assert (stats.allocations, stats.reuses, stats.buffer_sets, stats.namespaces) == (1, 2, 1, 1)
    assert stats.bytes == sum(t.numel() * t.element_size() for t in _tensors(_state()))


def test_buffers_start_private_and_the_first_process_hand_off_shares_them_once() -> None:
    state = _state(4)
    state["param"] = torch.nn.Parameter(torch.ones(5))  # requires grad
    staged = _writer().stage(state)
    # Private pages fault in faster: the job's first async_save blocks less.
    assert not any(t.is_shared() for t in _tensors(staged))
    assert not staged["param"].requires_grad and staged["param"].grad_fn is None
    # The PROCESS executor sends the staged dict through torch's ForkingPickler (in DCP's
    # executor thread): a plain dict arrives, the storages having moved into shared
    # memory in place, and the tensors travel as handles to those pages.
    copy = pickle.loads(ForkingPickler.dumps(staged))
    assert type(copy) is dict
    assert all(t.is_shared() for t in _tensors(staged) if t.numel())  # torch keeps empty ones
    assert all(t.is_shared() for t in _tensors(copy) if t.numel())
    _assert_same(copy, state)
    moved = _pointers(staged)
    del staged, copy
    # The next stage reuses the moved (now shared) buffers, and pickles them as handles:
    # the pages it copied into are the pages the child sees.
    state = _state(5)
    state["param"] = torch.nn.Parameter(torch.full((5,), 2.0))  # the same layout
    again = _writer().stage(state)
    assert _pointers(again) == moved
    copy = pickle.loads(ForkingPickler.dumps(again))
    assert _pointers(again) == moved  # nothing moved a second time
    _assert_same(copy, state)
    again["w"][0] += 1.0  # same pages: what the child reads is what the stage wrote
    assert torch.equal(copy["w"], again["w"])
    assert staging_stats().allocations == 1


def test_the_staged_copy_does_not_follow_the_training_state() -> None:
    state = _state(5)
    expected = _snapshot(state)
    staged = _writer().stage(state)
    with torch.no_grad():
        for t in _tensors(state):
            t.add_(1)
    state["nested"]["tags"].append("later")
    state["nested"]["count"] = 99
    _assert_same(staged, expected)


def test_non_tensor_leaves_may_change_between_saves_without_new_buffers() -> None:
    state = _state(6)
    state["extra"] = None
    _writer().stage(state)
    state["extra"] = {"epoch": 3}.get("epoch")  # None -> int
    state["nested"]["name"] = 12.5  # str -> float
    staged = _writer().stage(state)
    assert staged["extra"] == 3 and staged["nested"]["name"] == 12.5
    assert staging_stats().allocations == 1


def test_namespaces_have_their_own_buffers() -> None:
    a = _writer("job-a").stage(_state(7))
    b = _writer("job-b").stage(_state(7))
    assert set(_pointers(a)).isdisjoint(_pointers(b))
    assert staging_stats().namespaces == 2


# --- layout changes and release ------------------------------------------------------------
def _changed(kind: str) -> dict[str, Any]:
    state = _state(8)
    if kind == "shape":
        state["w"] = torch.randn(1001)
    elif kind == "dtype":
        state["w"] = state["w"].double()
    elif kind == "stride":
        state["nested"]["b"] = state["nested"]["b"].contiguous()
    elif kind == "key":
        state["new"] = torch.zeros(3)
    elif kind == "list length":
        state["nested"]["tags"].append(1)
    elif kind == "tensor to leaf":
        state["step"] = 8.0
    return state


@pytest.mark.parametrize(
    "kind", ["shape", "dtype", "stride", "key", "list length", "tensor to leaf"]
)
def test_a_new_layout_gets_new_buffers_and_frees_the_old(kind: str) -> None:
    staged = _writer().stage(_state(8))
    old = weakref.ref(staged["w"])
    del staged
    state = _changed(kind)
    staged = _writer().stage(state)
    _assert_same(staged, state)
    assert staging_stats().allocations == 2 and staging_stats().buffer_sets == 1
    gc.collect()
    assert old() is None  # the registry let go of the old layout's buffers


def test_release_staging_frees_the_buffers() -> None:
    staged = _writer("job-a").stage(_state(9))
    _writer("job-b").stage(_state(9))
    held = weakref.ref(staged["w"])
    nbytes = staging_stats().bytes // 2
    del staged
    assert tierckpt.release_staging("job-a") == nbytes  # the package-level entry point
    gc.collect()
    assert held() is None
    assert staging_stats().namespaces == 1
    assert tierckpt.release_staging("no-such-namespace") == 0
    assert tierckpt.release_staging() == nbytes
    stats = tierckpt.staging_stats()
    assert (stats.namespaces, stats.buffer_sets, stats.bytes) == (0, 0, 0)
    _writer("job-a").stage(_state(9))
    assert staging_stats().allocations == 3  # allocated afresh after the release


def test_release_while_a_save_holds_the_buffers_keeps_them_until_it_ends() -> None:
    state = _state(10)
    staged = _writer().stage(state)
    expected = _snapshot(state)
    release_staging()
    gc.collect()
    _assert_same(staged, expected)  # still intact for the save in flight
    held = weakref.ref(staged["w"])
    del staged
    gc.collect()
    assert held() is None


# --- buffers in use -----------------------------------------------------------------------
def test_buffers_of_an_unfinished_save_are_never_overwritten() -> None:
    first_state = _state(11)
    expected = _snapshot(first_state)
    in_flight = _writer().stage(first_state)  # its save has not finished
    second = _writer().stage(_state(12))
    assert set(_pointers(second)).isdisjoint(_pointers(in_flight))
    _assert_same(in_flight, expected)
    assert staging_stats().buffer_sets == 2
    del in_flight, second  # both saves ended
    third = _writer().stage(_state(13))
    _assert_same(third, _state(13))
    stats = staging_stats()
    assert (stats.allocations, stats.buffer_sets) == (2, 1)  # settles back to one set


def test_a_failed_copy_does_not_leave_the_buffers_marked_in_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pointers = _pointers(_writer().stage(_state(14)))
    real = staging._copy_into

    def failing(*args: Any) -> dict[str, Any]:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(staging, "_copy_into", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        _writer().stage(_state(15))
    monkeypatch.setattr(staging, "_copy_into", real)
    assert _pointers(_writer().stage(_state(16))) == pointers
    assert staging_stats().allocations == 1


def test_concurrent_stages_each_get_private_buffers() -> None:
    n = 4
    barrier = threading.Barrier(n)
    results: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def stage(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = _writer("ns" if i % 2 else "other").stage(_state(20 + i, n=50_000))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=stage, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for i, staged in results.items():  # all held at once: none overwrote another
        _assert_same(staged, _state(20 + i, n=50_000))
    all_pointers = [p for staged in results.values() for p in _pointers(staged)]
    assert len(all_pointers) == len(set(all_pointers))
    assert staging_stats().buffer_sets == n
    del staged
    results.clear()
    _writer("ns").stage(_state(30, n=50_000))
    _writer("other").stage(_state(31, n=50_000))
    assert staging_stats().buffer_sets == 2


# --- the writer ----------------------------------------------------------------------------
def test_the_writer_keeps_nothing_staged_and_still_pickles() -> None:
    writer = _writer()
    writer.reset("step-1")
    staged = writer.stage(_state(17))
    assert writer.per_thread_copy_ahead == 0  # the staged state is on the host already
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.state_dict_cache is None and copy.checkpoint_id == "step-1"
    _assert_same(staged, _state(17))


# --- DTensor ----------------------------------------------------------------------------------
@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensors_are_staged_privately_and_their_placement_is_layout(world_of_one: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = world_of_one
    state = {
        "w": distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]),
        "scalar": distribute_tensor(torch.tensor(3.0), mesh, [Replicate()]),
    }
    staged = _writer().stage(state)
    for key in state:
        assert isinstance(staged[key], DTensor)
        assert staged[key]._local_tensor.data_ptr() != state[key]._local_tensor.data_ptr()
    with torch.no_grad():
        state["w"]._local_tensor.add_(1)
        state["scalar"]._local_tensor.add_(1)  # torch's own helper would alias this 0-d one
    assert float(staged["scalar"]._local_tensor) == 3.0
    assert not torch.equal(staged["w"]._local_tensor, state["w"]._local_tensor)
    pointer = staged["w"]._local_tensor.data_ptr()
    del staged
    again = _writer().stage(state)
    assert again["w"]._local_tensor.data_ptr() == pointer
    assert torch.equal(again["w"]._local_tensor, state["w"]._local_tensor)
    del again
    state["w"] = distribute_tensor(torch.randn(6, 4), mesh, [Replicate()])
    staged = _writer().stage(state)
    assert staged["w"].placements == (Replicate(),)
    assert staging_stats().allocations == 2


# --- CUDA (runs where a GPU is present) -----------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_stages_into_pinned_shared_memory() -> None:
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _state(18).items()}
    state["nested"] = _state(18)["nested"]  # a CPU part in the same state dict
    expected = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    staged = _writer().stage(state)
    _assert_same(staged, expected)
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned() and staged["w"].is_shared()
    state["w"].add_(1)
    torch.cuda.synchronize()
    _assert_same(staged["w"], expected["w"])
    pointers = _pointers(staged)
    del staged
    assert _pointers(_writer().stage(state)) == pointers
