"""Save and load through a real tierckptd with real gloo ranks: bit-exact on every path.

Each rank checks its own restore (see tests/support/jobs.py): the target state is first
shown to differ from the saved snapshot in every leaf, then compared bit-exactly after
`dcp.load` and again after `set_state_dict` pushed it into the FSDP2 model and AdamW.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import jobs
from tests.support.backends import Tiered
from tests.support.cli import ls_json
from tests.support.dist_job import run_job
from tests.support.errors import assert_error, capture
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

pytestmark = pytest.mark.integration

NS = "run7"


def _files_on_disk(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_save_then_load_is_bit_exact(daemon: Any, tmp_path: Path, world: int) -> None:
    backend = Tiered(NS, daemon.address)
    results = run_job(
        jobs.save_and_load, world, backend, "step-000100", str(tmp_path / "exp"), 11, timeout=90
    )
    assert [r["leaves"] for r in results] == [results[0]["leaves"]] * world
    assert results[0]["leaves"] >= 20  # model, AdamW moments and steps, extras

    (row,) = ls_json(daemon.address, NS)
    assert row["id"] == "step-000100"
    assert row["state"] == "COMMITTED"
    on_disk = _files_on_disk(daemon.data_dir(NS, "step-000100"))
    assert ".metadata" in on_disk
    # One data file or more per rank (the writer's thread count), plus .metadata.
    data_files = [name for name in on_disk if name.endswith(".distcp")]
    assert {name.split("_")[2] for name in data_files} == {str(r) for r in range(world)}, on_disk
    assert row["files"] == len(on_disk)
    assert row["bytes"] == sum(on_disk.values())


def test_resharded_load_world_4_to_2(daemon: Any, tmp_path: Path) -> None:
    backend = Tiered(NS, daemon.address)
    expected = str(tmp_path / "exp")
    run_job(jobs.save_only, 4, backend, ["step-000200"], expected, 21, timeout=90)
    results = run_job(
        jobs.load_and_verify, 2, backend, "step-000200", f"{expected}/step-000200", timeout=90
    )
    assert [r["world"] for r in results] == [2, 2]


def test_resharded_load_world_2_into_one_process_without_pg(daemon: Any, tmp_path: Path) -> None:
    backend = Tiered(NS, daemon.address)
    expected = str(tmp_path / "exp")
    run_job(jobs.save_only, 2, backend, ["step-000300"], expected, 31, timeout=90)
    (result,) = run_job(
        jobs.load_plain_no_pg,
        1,
        backend,
        "step-000300",
        f"{expected}/step-000300",
        use_pg=False,
        timeout=90,
    )
    assert result["leaves"] >= 20


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_save_then_load_is_bit_exact(daemon: Any, tmp_path: Path, executor: str) -> None:
    # The ranks change every parameter and AdamW state in place between staging and the
    # end of the upload; the checkpoint must still hold the staged values.
    backend = Tiered(NS, daemon.address)
    results = run_job(
        jobs.save_and_load,
        2,
        backend,
        f"step-async-{executor}",
        str(tmp_path / "exp"),
        41,
        executor,
        timeout=100,
    )
    assert len(results) == 2
    assert [r["id"] for r in ls_json(daemon.address, NS)] == [f"step-async-{executor}"]


def test_checkpoint_id_none_loads_newest_committed(daemon_factory: Any, tmp_path: Path) -> None:
    daemon = daemon_factory({"retention": {"memory_keep_last": 0}})
    backend = Tiered(NS, daemon.address)
    root = tmp_path / "exp"
    ids = ["step-000100", "step-000200", "step-000300"]
    steps: list[tuple[Any, ...]] = [
        ("save", cid, str(root / cid), 50 + i) for i, cid in enumerate(ids)
    ]
    steps += [
        ("load", None, str(root / "step-000300")),  # newest
        ("load", "step-000100", str(root / "step-000100")),  # an older one is still exact
    ]
    run_job(jobs.run_steps, 2, backend, steps, timeout=120)
    assert sorted(r["id"] for r in ls_json(daemon.address, NS)) == ids


def test_newest_means_last_committed_not_highest_name(daemon: Any) -> None:
    # Single process, no process group. "Newest" is commit order (DESIGN: ordered by
    # commit sequence), so an id that sorts lower but was committed last wins.
    backend = Tiered("order", daemon.address)
    saved = {}
    for seed, cid in [(1, "step-000900"), (2, "step-000100")]:
        state = plain_tensor_state(seed, 64 << 10)
        saved[cid] = snapshot(state)
        backend.save(state, cid)
    target = plain_tensor_state(99, 64 << 10)
    backend.load(target, None)
    assert_state_equal(actual=target, expected=saved["step-000100"], what="checkpoint_id=None")


def test_newest_in_an_empty_namespace_is_not_found(daemon: Any) -> None:
    backend = Tiered("empty-ns", daemon.address)
    from tierckpt import CheckpointNotFound

    exc = capture(lambda: backend.load(plain_tensor_state(1, 1024), None), within=30)
    assert_error(exc, CheckpointNotFound, "empty-ns", load=True)
