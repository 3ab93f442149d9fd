"""async_save through a real tierckptd with real gloo ranks: a new writer per save reuses
the process's staging buffers (THREAD and PROCESS executors), torch's own DefaultStager
works with the writer, and every checkpoint loads back bit-exactly.

Reuse is asserted on the buffers themselves (the same data pointers every save) and on the
registry's allocation counter, never on a timing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.cli import ls_json
from tests.support.dist_job import run_job
from tests.support.staging_jobs import async_saves_with_new_writers

pytestmark = pytest.mark.integration

NS = "staged"
SAVES = 3
WORLD = 2


def _ids(prefix: str) -> list[str]:
    return [f"{prefix}-{i:06d}" for i in range(1, SAVES + 1)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_new_writer_per_async_save_reuses_the_staging_buffers(
    daemon: Any, tmp_path: Path, executor: str
) -> None:
    ids = _ids(f"step-{executor}")
    results = run_job(
        async_saves_with_new_writers,
        WORLD,
        NS,
        daemon.address,
        executor,
        ids,
        str(tmp_path / "exp"),
        61,
        timeout=240,
    )
    for rank, result in enumerate(results):
        # One buffer set, allocated by the first save; every later save copied into it.
        assert (result["allocations"], result["reuses"]) == (1, SAVES - 1), rank
        assert result["buffer_sets"] == 1, rank
        first = result["pointers"][0]
        assert len(first) == 1 and len(first[0]) >= 10, rank  # model and optimizer tensors
        assert result["pointers"] == [first] * SAVES, rank
        assert result["responses"] == ["Future"] * SAVES, rank  # staging done on return
    assert sorted(r["id"] for r in ls_json(daemon.address, NS)) == ids


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("executor", "stager"), [("thread", "default-async"), ("process", "default-sync")]
)
def test_async_save_with_torchs_default_stager(
    daemon: Any, tmp_path: Path, executor: str, stager: str
) -> None:
    # DCP stages with the given stager and never calls the writer's stage(): the writer
    # must still save what that stager staged, and our registry stays untouched.
    ids = _ids(f"step-{stager}")
    results = run_job(
        async_saves_with_new_writers,
        WORLD,
        NS,
        daemon.address,
        executor,
        ids,
        str(tmp_path / "exp"),
        71,
        stager,
        timeout=240,
    )
    expected_response = "AsyncSaveResponse" if stager == "default-async" else "Future"
    for rank, result in enumerate(results):
        assert (result["allocations"], result["buffer_sets"]) == (0, 0), rank
        assert result["responses"] == [expected_response] * SAVES, rank
    assert sorted(r["id"] for r in ls_json(daemon.address, NS)) == ids


# --- CUDA (runs where a GPU is present) -----------------------------------------------------
def _cuda_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(1 << 20, generator=gen).cuda(),
        "b": torch.randn(3, 7, generator=gen).to(torch.bfloat16).cuda().t(),
        "step": torch.tensor(float(seed)).cuda(),
        "host": torch.arange(10, dtype=torch.int64) * seed,  # a CPU tensor beside them
        "meta": {"epoch": seed},
    }


def _to_host(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_state_saves_and_loads_back_to_the_gpu_bit_exact(daemon: Any, mode: str) -> None:
    import torch.distributed.checkpoint as dcp
    from tierckpt import TieredStorageReader, TieredStorageWriter, release_staging, staging_stats

    release_staging(NS)
    before = staging_stats()
    state = _cuda_state(3)
    ids = [f"step-cuda-{mode}-{i}" for i in range(2)]
    expected: dict[str, dict[str, Any]] = {}
    for checkpoint_id in ids:
        expected[checkpoint_id] = _to_host(state)
        writer = TieredStorageWriter(NS, daemon=daemon.address)
        if mode == "sync":
            dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=writer)
        else:
            future = dcp.async_save(state, checkpoint_id=checkpoint_id, storage_writer=writer)
            state["w"].add_(1)  # training goes on on the GPU while the upload runs
            future.result(timeout=120)
        state["w"].add_(1)
        state["step"].add_(1)
    if mode == "async":  # the second save, through a new writer, reused the pinned buffers
        after = staging_stats()
        assert (after.allocations - before.allocations, after.reuses - before.reuses) == (1, 1)
    for checkpoint_id in ids:
        target = _cuda_state(99)
        dcp.load(
            target,
            checkpoint_id=checkpoint_id,
            storage_reader=TieredStorageReader(NS, daemon=daemon.address),
        )
        for key, value in expected[checkpoint_id].items():
            if isinstance(value, torch.Tensor):
                assert target[key].device.type == ("cpu" if key == "host" else "cuda"), key
                assert torch.equal(target[key].cpu(), value), (checkpoint_id, key)
            else:
                assert target[key] == value, (checkpoint_id, key)
