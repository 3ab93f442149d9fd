"""The next-save prewarm through a real tierckptd and real DCP saves, default config.

A new `TieredStorageWriter` per save (what most training code does): the first save
writes cold pages; after its commit the daemon prewarms segments named for its files,
tagged with the namespace, and the second save writes into them. Checked by what the
daemon counts (status, metrics), never by a timing; the second save loads bit-exact.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support import jobs
from tests.support.backends import Tiered
from tests.support.cli import cli, cli_json
from tests.support.dist_job import run_job
from tests.support.ports import free_ports

pytestmark = pytest.mark.integration

NS = "warm7"


def _status(daemon: Any) -> dict[str, Any]:
    status: dict[str, Any] = cli_json(daemon.address, "status")
    return status


def _files(daemon: Any, checkpoint_id: str) -> dict[str, int]:
    directory = daemon.data_dir(NS, checkpoint_id)
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}


def _wait_prewarmed(daemon: Any, nbytes: int, timeout: float = 60.0) -> dict[str, Any]:
    """Poll `status` until `nbytes` of prewarmed segments are ready and none pending."""
    deadline = time.monotonic() + timeout
    status = _status(daemon)
    while time.monotonic() < deadline:
        if status["prewarm_ready_bytes"] >= nbytes and status["prewarm_pending_bytes"] == 0:
            return status
        time.sleep(0.1)
        status = _status(daemon)
    raise AssertionError(f"prewarm did not reach {nbytes} bytes: {status}")


def _sample(body: str, name: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_the_second_save_writes_into_segments_prewarmed_for_it(
    daemon_factory: Any, tmp_path: Path
) -> None:
    (port,) = free_ports(1)
    daemon = daemon_factory({"metrics": {"listen": f"127.0.0.1:{port}"}})
    expected = tmp_path / "exp"
    steps = [("save", "step-1", str(expected / "step-1"), 1)]
    run_job(jobs.run_steps, 1, Tiered(NS, daemon.address), steps, timeout=90)
    first = _files(daemon, "step-1")
    assert any(name.endswith(".distcp") for name in first)
    size = sum(first.values())
    status = _wait_prewarmed(daemon, size)
    assert (status["pool_hits"], status["pool_misses"]) == (0, len(first))  # save 1: cold
    # One segment per file, for this namespace only.
    pool = sorted(p.name.split("@", 1)[1] for p in (daemon.memory_dir / "pool").iterdir())
    assert pool == [NS] * len(first)

    run_job(
        jobs.run_steps,
        1,
        Tiered(NS, daemon.address),
        [
            ("save", "step-2", str(expected / "step-2"), 2),
            ("load", "step-2", str(expected / "step-2")),  # every byte verified
        ],
        timeout=90,
    )
    second = _files(daemon, "step-2")
    assert set(second) == set(first)
    status = _status(daemon)
    # Every file of save 2 was opened in a segment prewarmed for it.
    assert (status["pool_hits"], status["pool_misses"]) == (len(second), len(first))
    assert status["prewarm_used_bytes"] == size
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        body = reply.read().decode()
    assert _sample(body, "tierckpt_pool_hits_total") == len(second)
    assert _sample(body, "tierckpt_prewarm_used_bytes_total") == size
    assert _sample(body, 'tierckpt_prewarm_bytes_total{kind="next_save"}') >= size
    # And again for save 3: the pool is warm after every commit.
    _wait_prewarmed(daemon, sum(second.values()))
    assert "prewarmed for next saves" in cli(daemon.address, "status").stdout


def test_prewarm_next_false_leaves_the_pool_alone(daemon_factory: Any, tmp_path: Path) -> None:
    daemon = daemon_factory({"memory": {"prewarm_next": False}})
    expected = tmp_path / "exp"
    run_job(
        jobs.run_steps,
        1,
        Tiered(NS, daemon.address),
        [
            ("save", "step-1", str(expected / "step-1"), 1),
            ("save", "step-2", str(expected / "step-2"), 2),
        ],
        timeout=90,
    )
    files = len(_files(daemon, "step-1")) + len(_files(daemon, "step-2"))
    status = _status(daemon)
    assert (status["pool_hits"], status["pool_misses"]) == (0, files)
    assert status["prewarm_ready_bytes"] == status["prewarm_used_bytes"] == 0
