"""Per-tier freshness (the RPO the daemon's gauge and `tierckpt status` show), and the
CLI's age and progress formatting."""

from __future__ import annotations

import io

import pytest
from tierckpt.freshness import Freshness, from_wire, levels, newest_by_tier
from tierckpt.progress import Progress, format_age
from tierckpt.v1 import daemon_pb2


@pytest.mark.parametrize(
    ("state", "tiers", "expected"),
    [
        ("COMMITTED", ("memory",), ("memory",)),
        ("COMMITTED", ("peer",), ("memory",)),
        ("REPLICATED", ("memory", "peer"), ("memory", "replicated")),
        ("DURABLE", ("memory", "peer", "persistent"), ("memory", "replicated", "durable")),
        ("DURABLE", ("persistent",), ("replicated", "durable")),  # evicted from memory
        ("LOST", ("peer", "lost"), ()),
        ("WRITING", (), ()),
        ("ABORTED", (), ()),
    ],
)
def test_levels_a_checkpoint_reached(
    state: str, tiers: tuple[str, ...], expected: tuple[str, ...]
) -> None:
    assert levels(state, tiers) == expected


def test_newest_per_namespace_and_tier() -> None:
    rows = [
        Freshness("a", "DURABLE", ("persistent",), 100.0),
        Freshness("a", "REPLICATED", ("memory", "peer"), 200.0),
        Freshness("a", "COMMITTED", ("memory",), 300.0),
        Freshness("a", "LOST", ("lost",), 400.0),  # cannot be restored: not counted
        Freshness("b", "COMMITTED", ("memory",), 50.0),
        Freshness("c", "COMMITTED", ("memory",), float("nan")),  # a hostile manifest
        Freshness("c", "COMMITTED", ("memory",), -1.0),
    ]
    assert newest_by_tier(rows) == {
        "a": {"memory": 300.0, "replicated": 200.0, "durable": 100.0},
        "b": {"memory": 50.0},
    }


def test_a_status_answer_is_checked_where_it_enters() -> None:
    """Names and timestamps from the wire: an invalid namespace, NaN, inf or a negative
    time is dropped, a level at 0 was not reached."""
    entries = [
        daemon_pb2.NamespaceFreshness(namespace="a", memory_unix=3.0, durable_unix=1.0),
        daemon_pb2.NamespaceFreshness(namespace="../etc", memory_unix=3.0),
        daemon_pb2.NamespaceFreshness(namespace="b\nforged", memory_unix=3.0),
        daemon_pb2.NamespaceFreshness(
            namespace="c", memory_unix=float("nan"), replicated_unix=float("inf")
        ),
        daemon_pb2.NamespaceFreshness(namespace="d", memory_unix=-5.0, replicated_unix=2.0),
    ]
    assert from_wire(entries) == {"a": {"memory": 3.0, "durable": 1.0}, "d": {"replicated": 2.0}}


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(-5, "0s"), (0, "0s"), (42.9, "42s"), (303, "5m03s"), (7440, "2h04m"), (277200, "3d05h")],
)
def test_format_age(seconds: float, shown: str) -> None:
    assert format_age(seconds) == shown


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_on_a_terminal_only() -> None:
    piped = io.StringIO()
    bar = Progress("pull ns/x", 4 << 20, 2, piped)
    bar.advance(1 << 20)
    bar.advance(files=1)
    bar.close()
    assert piped.getvalue() == ""  # scripts reading stderr see no control characters

    tty = _Terminal()
    bar = Progress("pull ns/x", 4 << 20, 2, tty)
    bar.advance(2 << 20, files=1)
    bar.advance(2 << 20, files=1)
    bar.close()
    drawn = tty.getvalue()
    assert drawn.startswith("\rpull ns/x [") and drawn.endswith("\n")
    last = drawn.rstrip("\n").rsplit("\r", 1)[-1]
    assert "100%" in last and "2/2 files" in last and "#" * 24 in last


def test_progress_of_an_empty_checkpoint() -> None:
    bar = Progress("pull ns/x", 0, 1, _Terminal())
    assert "100%" in bar.line(0.0)
