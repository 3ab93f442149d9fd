"""The writer carries each rank's node in its local plan and the coordinator hands the
set to the commit (`holder_nodes`), so the daemon asks those nodes for their files and
not the whole cluster; the plans DCP writes with keep FileSystemWriter's file prefixes."""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from tierckpt.storage_writer import TieredStorageWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan


class _Client:
    """The daemon calls `finish` makes, recorded (the RPCs themselves are covered by the
    integration tests)."""

    def __init__(self) -> None:
        self.commits: list[dict[str, Any]] = []

    def reserve_space(self, namespace: str, checkpoint_id: str, rank: int, nbytes: int) -> int:
        return nbytes

    def commit_checkpoint(
        self, namespace: str, checkpoint_id: str, required: Any, **kw: Any
    ) -> Any:
        self.commits.append(dict(kw, required=sorted(required)))
        return SimpleNamespace(file_count=1, size_bytes=1)


class _Files:
    """Where `finish` writes `.metadata` (kept in memory here)."""

    def __init__(self) -> None:
        self.written: dict[str, bytes] = {}

    def concat_path(self, path: str, suffix: str) -> str:
        return f"{path}/{suffix}"

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str) -> Iterator[io.BytesIO]:
        stream = io.BytesIO()
        yield stream
        self.written[path] = stream.getvalue()


def _rank_plan(node: str) -> SavePlan:
    writer = TieredStorageWriter("ns", daemon="unix:///tmp/x.sock")
    writer.reset("step-1")
    writer._node_id = node
    # A rank's local plan crosses to the coordinator pickled (gather_object).
    return pickle.loads(pickle.dumps(writer.prepare_local_plan(SavePlan([]))))


def test_the_coordinator_gathers_the_ranks_nodes_and_keeps_the_file_prefixes() -> None:
    plans = [_rank_plan(n) for n in ("n3", "n1", "n3", "")]
    coordinator = TieredStorageWriter("ns", daemon="unix:///tmp/x.sock")
    coordinator.reset("step-1")
    out = coordinator.prepare_global_plan(plans)
    assert coordinator._holder_nodes == ("n1", "n3")
    assert [p.storage_data for p in out] == [_StoragePrefix(f"__{i}_") for i in range(4)]
    coordinator.reset("step-2")  # a reused writer starts each save without hints
    assert coordinator._holder_nodes == ()


def test_finish_passes_the_holders_to_the_commit(monkeypatch: Any) -> None:
    writer = TieredStorageWriter("ns", daemon="unix:///tmp/x.sock", durable=True)
    writer.reset("step-1")
    writer.prepare_global_plan([_rank_plan("n2"), _rank_plan("n5")])
    client, files = _Client(), _Files()
    monkeypatch.setattr(writer, "client", client)
    monkeypatch.setattr(writer, "fs", files)
    writer.finish(Metadata(state_dict_metadata={}), [[], []])
    assert list(files.written) == ["step-1/.metadata"]
    assert client.commits == [
        {"durable": True, "holder_nodes": ("n2", "n5"), "required": [".metadata"]}
    ]
