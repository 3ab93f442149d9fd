"""The records client and daemon share are one type: the daemon's status is the client's
`NodeStatus`, and it crosses GetStatus whole (every field, by name, both ways)."""

from __future__ import annotations

import dataclasses

import tierckpt.daemon_client as daemon_client
import tierckpt.records as records
from tierckpt.daemon_client import status_from_wire
from tierckpt.records import NodeStatus
from tierckpt.v1 import daemon_pb2
from tierckptd import model
from tierckptd.wire import node_status


def _distinct_status() -> NodeStatus:
    """A status whose every field holds a value of its own, so a field dropped or
    swapped on the way shows."""
    values: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(NodeStatus), start=1):
        if f.name in ("node_id", "failure_domain", "memory_dir", "version"):
            values[f.name] = f"{f.name}-{i}"
        elif f.name == "namespaces":
            values[f.name] = ("jobA", "jobB")
        elif f.name == "peer_clocks":
            values[f.name] = {"n2": 12.5, "n3": -4.0}
        elif f.name == "freshness":
            values[f.name] = {
                "jobA": {"memory": 30.0, "replicated": 20.0},
                "jobB": {"durable": 9.0},
            }
        else:
            values[f.name] = 1000 + i
    return NodeStatus(**values)  # type: ignore[arg-type]


def test_status_crosses_the_wire_whole() -> None:
    status = _distinct_status()
    assert status_from_wire(node_status(status)) == status


def test_every_wire_field_of_the_status_is_a_record_field() -> None:
    wire = {f.name for f in daemon_pb2.NodeStatus.DESCRIPTOR.fields}
    assert wire == {f.name for f in dataclasses.fields(NodeStatus)}
    assert set(NodeStatus.scalar_fields()) < wire


def test_the_daemon_and_the_client_use_one_record() -> None:
    assert model.NodeStatus is NodeStatus
    assert not hasattr(model, "NodeStatusView")
    for name in records.__all__:  # user imports from daemon_client keep working
        assert getattr(daemon_client, name) is getattr(records, name)
