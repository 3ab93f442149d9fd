"""Per-tier completion (issue 25 point 3) against real daemons: `tierckpt.wait_for` on an
async_save future, a writer and a `tierckpt://` id, the CLI's `wait`/`info`/`ls` and
fsspec's `info()`.

"replicated" is checked by what survives: right after the wait returns the owner dies
with its memory and the buddy serves a bit-exact load. "durable" is checked against the
moto bucket directly (s3fs), with the drain of `.metadata` held back by a fault point so
that a wait that returned early would find it missing. Timeouts are short and must name
the tier.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import tierckpt
import torch.distributed.checkpoint as dcp
from tierckpt import Tier, TieredStorageWriter, TierTimeout
from tierckpt.fsspec_fs import TierckptFileSystem
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tests.support import jobs, moto_s3
from tests.support.backends import Nodes, Tiered
from tests.support.cli import cli, cli_json, ls_json
from tests.support.cluster import local_cluster
from tests.support.completion_jobs import async_save_and_wait
from tests.support.dist_job import run_job
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

# One namespace per test: a process remembers which daemon its writers of a namespace
# saved through (`completion.note_writer`), and these daemons die with their test.
NS = "tiers"
NS_FSSPEC = "tiers-fsspec"
NS_DURABLE = "tiers-durable"
NBYTES = 2 << 20


def _async_save(state: dict[str, Any], checkpoint_id: str, writer: Any = None) -> Any:
    """One process, no process group: DCP's THREAD executor, as a training loop calls it."""
    return dcp.async_save(
        state,
        checkpoint_id=checkpoint_id,
        storage_writer=writer,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        no_dist=True,
    )


def test_replicated_wait_returns_once_a_buddy_holds_every_file(tmp_path: Path) -> None:
    with local_cluster(2, namespace=NS, copies=1) as c:
        owner, buddy = c.nodes
        state = plain_tensor_state(5, NBYTES)
        expected = snapshot(state)
        writer = TieredStorageWriter(NS, daemon=owner.address)
        future = _async_save(state, "step-000001", writer)

        reached = tierckpt.wait_for(future, Tier.REPLICATED, copies=2, timeout=60)

        # The buddy holds a copy of every file the owner wrote, now, not eventually.
        written = {p.name for p in owner.data_dir(NS, "step-000001").iterdir()}
        held = {p.name for p in buddy.data_dir(NS, "step-000001").iterdir()}
        assert ".metadata" in written and written <= held, (written, held)
        assert (reached.checkpoint_id, reached.copies, reached.in_memory) == (
            "step-000001",
            2,
            True,
        )
        # Every way of naming the save agrees, and asks no more of a reached tier.
        for named in (writer, f"tierckpt://{NS}/step-000001", f"{NS}/step-000001"):
            again = tierckpt.wait_for(named, "replicated", timeout=5, daemon=owner.address)
            assert again.copies == 2
        c.lose(0)  # the owner dies with its RAM right after the wait

        target = plain_tensor_state(99, NBYTES)
        Tiered(NS, buddy.address).load(target, "step-000001")
        assert_state_equal(actual=target, expected=expected, what="load from the buddy")


@pytest.mark.timeout(300)
def test_gloo_ranks_wait_on_their_process_async_save_futures_for_a_buddy(tmp_path: Path) -> None:
    """2 gloo ranks, one per node, DCP's PROCESS executor: each rank waits on its own
    future (the save's `.metadata` travels back from DCP's child process and names the
    checkpoint; the rank's writer names the daemon). When both waits are over, node 0
    dies with its RAM and both ranks load bit-exact through node 1 alone."""
    with local_cluster(2, namespace=NS, copies=1) as c:
        results = run_job(
            async_save_and_wait,
            2,
            Nodes(NS, c.addresses, 1),
            "step-000010",
            str(tmp_path),
            31,
            "process",
            "replicated",
            2,
            timeout=240,
        )
        assert [r["checkpoint_id"] for r in results] == ["step-000010"] * 2
        assert all(r["levels"]["replicated"] >= 2 for r in results), results
        written = {p.name for p in c.nodes[0].data_dir(NS, "step-000010").iterdir()}
        assert written <= {p.name for p in c.nodes[1].data_dir(NS, "step-000010").iterdir()}
        c.lose(0)
        loaded = run_job(
            jobs.load_and_verify,
            2,
            Tiered(NS, c.nodes[1].address),
            "step-000010",
            str(tmp_path / "step-000010"),
            timeout=180,
        )
        assert [r["world"] for r in loaded] == [2, 2]


def test_timeouts_name_the_tier_and_the_cli_and_fsspec_show_the_state(
    daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One daemon, no peers, no persistent tier: memory is reached, replicated to 2 and
    durable never are; each wait gives up at its timeout with the tier in the error."""
    monkeypatch.setenv("TIERCKPT_DAEMON", daemon.address)
    state = plain_tensor_state(6, NBYTES)
    # The fsspec route: DCP's own writer for the URL; its future names the checkpoint too.
    future = _async_save(state, f"tierckpt://{NS_FSSPEC}/step-000002")
    reached = tierckpt.wait_for(future, Tier.MEMORY, timeout=60)
    assert reached.reached(Tier.MEMORY) and reached.copies == 1 and not reached.durable

    for tier, wanted in ((Tier.REPLICATED, "replicated tier"), (Tier.DURABLE, "durable tier")):
        started = time.monotonic()
        with pytest.raises(TierTimeout) as caught:
            tierckpt.wait_for(f"{NS_FSSPEC}/step-000002", tier, copies=2, timeout=1.5)
        assert 1.5 <= time.monotonic() - started < 10
        assert caught.value.tier == tier.value and wanted in str(caught.value)
        assert "step-000002" in str(caught.value)
    with pytest.raises(TierTimeout, match="memory tier") as never:
        tierckpt.wait_for(f"{NS_FSSPEC}/step-999999", timeout=1.0)  # never saved
    assert never.value.tier == "memory"

    # The CLI: zero on a reached tier, non-zero with the reason on a timeout.
    ok = cli(
        daemon.address, "wait", f"{NS_FSSPEC}/step-000002", "--tier", "memory", "--timeout", "30"
    )
    assert "reached the memory tier" in ok.stdout
    late = cli(
        daemon.address,
        "wait",
        NS_FSSPEC,
        "step-000002",
        "--tier",
        "replicated",
        "--copies",
        "2",
        "--timeout",
        "1",
        check=False,
    )
    assert late.returncode == 1, late
    assert "replicated tier not reached within 1.0 s" in late.stderr, late.stderr
    levels = {"memory": True, "replicated": 1, "durable": False}
    info = cli_json(daemon.address, "info", f"tierckpt://{NS_FSSPEC}/step-000002")
    assert info["levels"] == levels and info["state"] == "COMMITTED"
    assert [r["levels"] for r in ls_json(daemon.address, NS_FSSPEC)] == [levels]
    assert "COPIES" in cli(daemon.address, "ls", NS_FSSPEC).stdout
    fs = TierckptFileSystem(daemon=daemon.address)
    assert fs.info(f"tierckpt://{NS_FSSPEC}/step-000002")["levels"] == levels
    assert tierckpt.tier_state(f"tierckpt://{NS_FSSPEC}/step-000002").levels() == levels


def test_durable_wait_returns_once_s3_holds_the_metadata(
    daemon_factory: Any, s3: moto_s3.S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `.metadata` goes up 3 s after the data files: a wait returning early would see none.
    monkeypatch.setenv("TIERCKPT_FAULT", "drain.metadata:delay=3")
    persistent = {"url": s3.url(), "storage_options": dict(s3.storage_options)}
    node = daemon_factory({"persistent": persistent})
    monkeypatch.delenv("TIERCKPT_FAULT")
    metadata = f"{s3.name}/{NS_DURABLE}/step-000003/.metadata"
    fs = s3.fs()

    writer = TieredStorageWriter(NS_DURABLE, daemon=node.address)
    future = _async_save(plain_tensor_state(7, NBYTES), "step-000003", writer)
    in_memory = tierckpt.wait_for(future, Tier.MEMORY, timeout=60)
    fs.invalidate_cache()
    assert not in_memory.durable and not fs.exists(metadata)

    durable = tierckpt.wait_for(writer, Tier.DURABLE, timeout=90)
    fs.invalidate_cache()
    assert durable.durable and durable.state == "DURABLE"
    assert fs.exists(metadata) and fs.info(metadata)["size"] > 0
    done = cli(
        node.address, "wait", f"{NS_DURABLE}/step-000003", "--tier", "durable", "--timeout", "5"
    )
    assert "reached the durable tier" in done.stdout
