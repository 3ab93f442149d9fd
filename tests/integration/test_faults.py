"""Crashes: the daemon killed with SIGKILL, stopped with SIGTERM, a rank killed mid-save."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import jobs
from tests.support.backends import Tiered
from tests.support.cli import cli, ls_ids, ls_json
from tests.support.dist_job import run_job, start_job
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

pytestmark = pytest.mark.integration

NS = "crashy"


def test_daemon_sigkill_then_restart_readopts_committed(daemon: Any, tmp_path: Path) -> None:
    backend = Tiered(NS, daemon.address)
    root = tmp_path / "exp"
    run_job(jobs.save_only, 2, backend, ["step-000100"], str(root), 61, timeout=90)
    before = ls_json(daemon.address, NS)
    assert [r["id"] for r in before] == ["step-000100"]

    daemon.kill9()
    assert not daemon.running
    daemon.start()  # same config, same memory dir

    after = ls_json(daemon.address, NS)
    assert [(r["id"], r["state"], r["bytes"], r["files"]) for r in after] == [
        (r["id"], "COMMITTED", r["bytes"], r["files"]) for r in before
    ]
    # Load what was re-adopted, then keep going: a new save after the restart, and
    # "newest" is the new one.
    run_job(
        jobs.run_steps,
        2,
        backend,
        [
            ("load", "step-000100", str(root / "step-000100")),
            ("save", "step-000200", str(root / "step-000200"), 62),
            ("load", None, str(root / "step-000200")),
        ],
        timeout=90,
    )
    assert ls_ids(daemon.address, NS) == ["step-000100", "step-000200"]


def test_daemon_sigterm_exits_zero_and_keeps_checkpoints(daemon: Any) -> None:
    backend = Tiered(NS, daemon.address)
    state = plain_tensor_state(5, 256 << 10)
    expected = snapshot(state)
    backend.save(state, "step-000001")

    assert daemon.terminate() == 0
    daemon.start()

    target = plain_tensor_state(6, 256 << 10)
    backend.load(target, "step-000001")
    assert_state_equal(actual=target, expected=expected, what="load after SIGTERM + restart")


def _wait_gone(path: Path, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize(
    ("stall", "victim"),
    [("before_commit", 0), ("before_commit", 1), ("mid_write", 1)],
    ids=["before-commit-coordinator", "before-commit-rank1", "mid-write-rank1"],
)
def test_rank_killed_mid_save_keeps_previous_and_collects_partial(
    daemon: Any, tmp_path: Path, stall: str, victim: int
) -> None:
    backend = Tiered(NS, daemon.address)
    root = tmp_path / "exp"
    job = start_job(
        jobs.save_then_hang_in_second_save,
        2,
        NS,
        daemon.address,
        "step-000100",
        "step-000200",
        str(root),
        71,
        stall,
        timeout=120,
    )
    try:
        # Both ranks are inside the step-000200 save: done writing (before_commit) or
        # in the middle of their bytes (mid_write); nothing is committed.
        job.wait_for_marker("in_write", [0, 1], timeout=90)
        partial = daemon.data_dir(NS, "step-000200")
        assert partial.is_dir() and any(partial.iterdir()), (
            f"no files of the in-flight save under {partial}"
        )
        # In flight: not listed by default. `ls --all` is checked at the end, so that a
        # listing bug does not hide the recovery checks below.
        assert ls_ids(daemon.address, NS) == ["step-000100"]
        listing_all = cli(daemon.address, "ls", NS, "--all", "--json", check=False)

        job.kill_rank(victim)
        job.kill_all()
    finally:
        job.cleanup()

    assert ls_ids(daemon.address, NS) == ["step-000100"]
    # The previous checkpoint loads bit-exactly; the next save succeeds.
    run_job(
        jobs.run_steps,
        2,
        backend,
        [
            ("load", "step-000100", str(root / "step-000100")),
            ("save", "step-000300", str(root / "step-000300"), 72),
        ],
        timeout=90,
    )
    assert ls_ids(daemon.address, NS) == ["step-000100", "step-000300"]
    assert _wait_gone(partial), (
        f"partial save still on disk after the next successful save: "
        f"{sorted(p.name for p in partial.iterdir())}"
    )
    states = {r["id"]: r["state"] for r in ls_json(daemon.address, NS, include_all=True)}
    assert states.get("step-000200") in (None, "ABORTED"), states

    # While the save was in flight, `ls --all` listed it as WRITING.
    assert listing_all.returncode == 0, (
        f"`tierckpt ls {NS} --all --json` during the save exited {listing_all.returncode}:\n"
        f"{listing_all.stderr}"
    )
    in_flight = {r["id"]: r["state"] for r in json.loads(listing_all.stdout)}
    assert in_flight == {"step-000100": "COMMITTED", "step-000200": "WRITING"}


def test_daemon_killed_mid_save_restarts_without_the_partial(daemon: Any, tmp_path: Path) -> None:
    backend = Tiered(NS, daemon.address)
    root = tmp_path / "exp"
    job = start_job(
        jobs.save_then_hang_in_second_save,
        2,
        NS,
        daemon.address,
        "step-000100",
        "step-000200",
        str(root),
        73,
        timeout=120,
    )
    try:
        job.wait_for_marker("in_write", [0, 1], timeout=90)
        daemon.kill9()
        daemon.start()
        # The re-adopted tier holds the committed checkpoint only.
        assert ls_ids(daemon.address, NS) == ["step-000100"]
        states = {r["id"]: r["state"] for r in ls_json(daemon.address, NS, include_all=True)}
        assert states["step-000100"] == "COMMITTED"
        assert states.get("step-000200") != "COMMITTED", states
    finally:
        job.cleanup()

    partial = daemon.data_dir(NS, "step-000200")
    run_job(
        jobs.run_steps,
        2,
        backend,
        [
            ("load", "step-000100", str(root / "step-000100")),
            ("save", "step-000300", str(root / "step-000300"), 74),
            ("load", None, str(root / "step-000300")),
        ],
        timeout=90,
    )
    assert ls_ids(daemon.address, NS) == ["step-000100", "step-000300"]
    assert _wait_gone(partial), (
        f"partial save still on disk after the next successful save: "
        f"{sorted(p.name for p in partial.iterdir())}"
    )
