"""What `tierckpt.completion` reads from a daemon's answer and from the ways a save is
named; the waits against real daemons are in tests/integration/test_tier_completion.py."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from tierckpt import InvalidArgument, InvalidName, TierTimeout
from tierckpt.completion import CheckpointRef, Tier, TierState, checkpoint_ref, note_writer
from tierckpt.records import CheckpointInfo, FileEntry
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


def _info(state: str, holders: dict[str, tuple[str, ...]]) -> CheckpointInfo:
    files = tuple(
        FileEntry(name, 10, None, 0, nodes[0] if nodes else "", nodes[1:], "")
        for name, nodes in holders.items()
    )
    return CheckpointInfo(
        "ns", "step-1", state, 20, len(files), 1.0, 2.0, 1, ("memory",), False, files
    )


def test_copies_are_the_fewest_holders_of_any_file() -> None:
    s = TierState.of(_info("COMMITTED", {".metadata": ("n0", "n1"), "__0_0.distcp": ("n0",)}))
    assert (s.copies, s.fewest_copies_file, s.in_memory, s.durable) == (
        1,
        "__0_0.distcp",
        True,
        False,
    )
    assert s.reached(Tier.MEMORY) and s.reached(Tier.REPLICATED, copies=1)
    assert not s.reached(Tier.REPLICATED, copies=2) and not s.reached(Tier.DURABLE)
    # the owner listed again as a replica is one node, not two
    s = TierState.of(_info("REPLICATED", {"a": ("n0", "n0", "n1", "n2")}))
    assert s.copies == 3 and s.levels() == {"memory": True, "replicated": 3, "durable": False}


def test_durable_and_lost() -> None:
    durable = TierState.of(_info("DURABLE", {"a": ("n0",)}))
    assert durable.reached("durable") and durable.reached("memory")
    lost = TierState.of(_info("LOST", {"a": ("n0",)}))
    assert lost.levels() == {"memory": False, "replicated": 0, "durable": False}
    assert not lost.reached(Tier.MEMORY)


def test_names_of_a_checkpoint() -> None:
    assert checkpoint_ref("tierckpt://run7/step-000100") == CheckpointRef("run7", "step-000100")
    assert checkpoint_ref("run7/step-1", daemon="unix:///x.sock").daemon == "unix:///x.sock"
    assert checkpoint_ref("tierckpt://team/run1/step-10/") == CheckpointRef("team", "run1/step-10")
    for bad in ("run7", "", 42):
        with pytest.raises(InvalidArgument):
            checkpoint_ref(bad)
    for bad in ("tierckpt://../step-1", "team/run1/../x", "team/run1//x", "team/.tierckpt/x"):
        with pytest.raises(InvalidName):
            checkpoint_ref(bad)


def test_a_future_names_its_checkpoint_by_its_metadata() -> None:
    future: concurrent.futures.Future[Metadata] = concurrent.futures.Future()
    future.set_result(Metadata({}, storage_meta=StorageMeta("tierckpt://unit-ns/step-7")))
    note_writer("unit-ns", "unix:///writer.sock")
    assert checkpoint_ref(future) == CheckpointRef("unit-ns", "step-7", "unix:///writer.sock")
    note_writer("unit-ns", "unix:///that-save.sock", "step-7")
    assert checkpoint_ref(future).daemon == "unix:///that-save.sock"
    assert checkpoint_ref(future, daemon="unix:///named").daemon == "unix:///named"

    local: concurrent.futures.Future[Metadata] = concurrent.futures.Future()
    local.set_result(Metadata({}, storage_meta=StorageMeta("/checkpoints/step-7")))
    with pytest.raises(InvalidArgument, match="not a tierckpt:// checkpoint"):
        checkpoint_ref(local)


def test_a_future_still_running_times_out_naming_the_memory_tier() -> None:
    pending: concurrent.futures.Future[Metadata] = concurrent.futures.Future()
    started = time.monotonic()
    with pytest.raises(TierTimeout, match="memory tier") as caught:
        checkpoint_ref(pending, timeout=0.2)
    assert caught.value.tier == "memory" and time.monotonic() - started < 5
    failed: concurrent.futures.Future[Metadata] = concurrent.futures.Future()
    failed.set_exception(OSError("rank 1 failed"))
    with pytest.raises(OSError, match="rank 1 failed"):
        checkpoint_ref(failed)
