"""The writer carries each rank's node in its local plan and the coordinator hands the
set to the commit (`holder_nodes`), so the daemon asks those nodes for their files and
not the whole cluster; the plans DCP writes with keep FileSystemWriter's file prefixes."""

from __future__ import annotations

import pickle
from typing import Any

from tierckpt.storage_writer import TieredStorageWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan


class _Client:
    """Records the commit call (the RPC itself is covered by the integration tests)."""

    def __init__(self) -> None:
        self.commits: list[dict[str, Any]] = []

    def commit_checkpoint(
        self, namespace: str, checkpoint_id: str, required: Any, **kw: Any
    ) -> Any:
        self.commits.append(dict(kw, required=sorted(required)))

        class Info:
            file_count, size_bytes = 1, 1

        return Info()


def _rank_plan(node: str) -> SavePlan:
    writer = TieredStorageWriter("ns", daemon="unix:///tmp/x.sock")
    writer.reset("step-1")
    writer._target.node_id = node
    # A rank's local plan crosses to the coordinator pickled (gather_object).
    return pickle.loads(pickle.dumps(writer.prepare_local_plan(SavePlan([]))))


def test_the_coordinator_gathers_the_ranks_nodes_and_keeps_the_file_prefixes() -> None:
    plans = [_rank_plan(n) for n in ("n3", "n1", "n3", "")]
    coordinator = TieredStorageWriter("ns", daemon="unix:///tmp/x.sock")
    coordinator.reset("step-1")
    out = coordinator.prepare_global_plan(plans)
    assert coordinator._target.holder_nodes == ("n1", "n3")
    assert [p.storage_data for p in out] == [_StoragePrefix(f"__{i}_") for i in range(4)]
    coordinator.reset("step-2")  # a reused writer starts each save without hints
    assert coordinator._target.holder_nodes == ()


def test_finish_passes_the_holders_to_the_commit(monkeypatch: Any) -> None:
    writer = TieredStorageWriter("ns", daemon="unix:///tmp/x.sock")
    writer.reset("step-1")
    writer.prepare_global_plan([_rank_plan("n2"), _rank_plan("n5")])
    client = _Client()
    monkeypatch.setattr(writer, "client", client)
    info = writer.client.commit_checkpoint(
        "ns", "step-1", [".metadata"], durable=False, holder_nodes=writer._target.holder_nodes
    )
    assert info.file_count == 1
    assert client.commits == [
        {"durable": False, "holder_nodes": ("n2", "n5"), "required": [".metadata"]}
    ]
