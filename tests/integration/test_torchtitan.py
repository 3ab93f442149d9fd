"""torchtitan 0.3.0's real `CheckpointManager` with ``--checkpoint.folder tierckpt://team/run1``.

Two gloo ranks (tests/support/torchtitan_jobs.py) build what torchtitan's trainer hands the
manager -- an FSDP2 model (`fully_shard` on a CPU mesh), its OptimizersContainer,
LRSchedulersContainer and ParallelAwareDataloader, a train state -- and call its `save`,
`load`, purge (``keep_latest_k=2``) and latest-step discovery unmodified. Each rank talks to
its own node's daemon; two real daemons, one buddy copy (copies=1). Every resume runs in new
processes and is compared bit-exact with what the saving run recorded. Also: the resume
after a node is lost (its replacement serves the files from its buddy), one save in
``async_mode="async"``, and a restart from an older step that re-saves an existing step
(other bytes): the save replaces it atomically on both nodes, the resume loads the new
bytes bit-exact, and so does the resume served from the buddy after a node is lost.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support import torchtitan_jobs
from tests.support.cluster import LocalCluster, local_cluster
from tests.support.dist_job import run_job
from tests.support.state_dicts import load_expected

pytestmark = pytest.mark.integration

NS = "team"
FOLDER = f"tierckpt://{NS}/run1"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with local_cluster(2, namespace=NS, copies=1) as c:
        yield c


@pytest.fixture(scope="module")
def saved(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 10, 20, 30 saved by torchtitan into run1; the step-30 state recorded."""
    record = tmp_path_factory.mktemp("titan") / "step-30"
    results = run_job(
        torchtitan_jobs.train_and_save,
        2,
        list(cluster.addresses),
        FOLDER,
        30,
        str(record),
        1,
        timeout=200,
    )
    assert [r["found"] for r in results] == [30, 30]  # torchtitan's own discovery
    return record


def _ids(c: LocalCluster, node: int) -> list[str]:
    return sorted(c.rows(node))


@pytest.mark.timeout(300)
def test_save_purges_to_the_latest_two_and_discovers_step_30(
    cluster: LocalCluster, saved: Path
) -> None:
    for node in (0, 1):
        assert _ids(cluster, node) == ["run1/step-20", "run1/step-30"]
    assert {r["state"] for r in cluster.rows(0).values()} <= {"COMMITTED", "REPLICATED"}


@pytest.mark.timeout(300)
def test_new_processes_resume_the_latest_step_bit_exact(cluster: LocalCluster, saved: Path) -> None:
    results = run_job(
        torchtitan_jobs.resume, 2, list(cluster.addresses), FOLDER, str(saved), 2, timeout=200
    )
    assert [r["step"] for r in results] == [30, 30]
    assert all(r["leaves"] > 10 for r in results), results


@pytest.fixture(scope="module")
def resaved(cluster: LocalCluster, saved: Path) -> Path:
    """torchtitan restarted from step 20 re-saves step 30 (other bytes); its record."""
    record = saved.parent / "step-30-resaved"
    results = run_job(
        torchtitan_jobs.resave_existing_step,
        2,
        list(cluster.addresses),
        FOLDER,
        20,
        30,
        str(record),
        timeout=200,
    )
    assert [(r["loaded"], r["found"]) for r in results] == [(20, 30)] * 2
    return record


@pytest.mark.timeout(300)
def test_a_restart_from_an_older_step_resaves_an_existing_step(
    cluster: LocalCluster, saved: Path, resaved: Path
) -> None:
    # torchtitan re-saves step 30 after resuming from step 20, as it overwrites a local
    # folder: the save replaces the committed id atomically, on both nodes.
    old, new = load_expected(str(saved), 0), load_expected(str(resaved), 0)
    changed = [
        not torch.equal(a, b)
        for a, b in zip(old["model"].values(), new["model"].values(), strict=True)
    ]
    assert any(changed), "the re-saved step holds the first run's bytes: it would prove nothing"
    cluster.wait_state("run1/step-30", "REPLICATED")
    for node in (0, 1):
        assert _ids(cluster, node) == ["run1/step-20", "run1/step-30"]
    # New processes resume the re-saved step 30, bit-exact with what the restart saved.
    results = run_job(
        torchtitan_jobs.resume, 2, list(cluster.addresses), FOLDER, str(resaved), 7, timeout=200
    )
    assert [r["step"] for r in results] == [30, 30]


@pytest.mark.timeout(300)
def test_one_async_save_resumes_bit_exact(cluster: LocalCluster, tmp_path: Path) -> None:
    folder, record = f"tierckpt://{NS}/run2", str(tmp_path / "step-10")
    addresses = list(cluster.addresses)
    results = run_job(
        torchtitan_jobs.train_and_save, 2, addresses, folder, 10, record, 3, "async", timeout=200
    )
    assert [(r["found"], r["async"]) for r in results] == [(10, "async")] * 2
    assert "run2/step-10" in cluster.rows(0)
    results = run_job(torchtitan_jobs.resume, 2, addresses, folder, record, 4, timeout=200)
    assert [r["step"] for r in results] == [10, 10]


@pytest.mark.timeout(300)
def test_a_lost_node_is_replaced_and_the_resume_is_served_from_its_buddy(
    cluster: LocalCluster, resaved: Path
) -> None:
    # Runs last: node 1 dies with its RAM; a replacement daemon starts on the same config,
    # empty, and rank 1 (pointed at it as before) resumes from node 0's copy.
    cluster.wait_state("run1/step-30", "REPLICATED")
    cluster.lose(1)
    assert not cluster.nodes[1].memory_dir.exists()
    cluster.replace(1)
    results = run_job(
        torchtitan_jobs.resume, 2, list(cluster.addresses), FOLDER, str(resaved), 6, timeout=200
    )
    assert [r["step"] for r in results] == [30, 30]
    # Rank 1's shard is back on the replacement; node 0 held the only other copy.
    restored = cluster.nodes[1].data_dir(NS, "run1/step-30")
    assert (restored / "__1_0.distcp").is_file(), sorted(p.name for p in restored.iterdir())
