"""Bulk grants (`peers.bulk_grants`) and ranged landing (`memory.incoming`): one use,
expiry, the send slots, and a range verified against its own blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import ChecksumMismatch, InvalidArgument, PermissionDenied
from tierckptd.memory.incoming import IncomingFile, split_ranges
from tierckptd.model import FileRecord
from tierckptd.peers.bulk_client import CANNOT_CONNECT
from tierckptd.peers.bulk_grants import Grants, SendersBusy
from tierckptd.peers.client import Holdings, PeerCallError
from tierckptd.peers.source import PeerSource


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def issue(grants: Grants) -> bytes:
    return grants.issue("n1", "10.0.0.1", "ns", "step-1", "__0_0.distcp", 0, 10)


def test_a_grant_serves_once_and_expires() -> None:
    clock = Clock()
    grants = Grants(ttl=5.0, clock=clock)
    token = issue(grants)
    grant = grants.redeem(token)
    assert (grant.peer, grant.address, grant.name, grant.length) == (
        "n1",
        "10.0.0.1",
        "__0_0.distcp",
        10,
    )
    grants.done()
    with pytest.raises(PermissionDenied, match="unknown, used or expired"):
        grants.redeem(token)
    token = issue(grants)
    clock.now += 5.0
    with pytest.raises(PermissionDenied, match="unknown, used or expired"):
        grants.redeem(token)
    with pytest.raises(PermissionDenied):
        grants.redeem(b"\0" * 32)
    assert grants.outstanding == 0 and grants.sending == 0


def test_grants_and_sends_share_the_send_slots() -> None:
    clock = Clock()
    grants = Grants(ttl=5.0, send_slots=2, clock=clock)
    first = issue(grants)
    issue(grants)
    with pytest.raises(SendersBusy, match="busy"):
        issue(grants)
    grants.redeem(first)  # one running, one granted: still full
    with pytest.raises(SendersBusy):
        issue(grants)
    clock.now += 6.0  # the unused grant expires; the send still runs
    issue(grants)
    with pytest.raises(SendersBusy):
        issue(grants)
    grants.done()
    issue(grants)


def test_ranges_land_out_of_order_each_verified_against_its_blocks(tmp_path: Path) -> None:
    block = 1 << 16
    data = bytes(range(256)) * ((5 * block + 123) // 256 + 1)
    data = data[: 5 * block + 123]
    cs = checksum_bytes(data, block)
    f = FileRecord(name="x", rank=0, size=len(data), checksums=cs)
    parts = split_ranges(f, 3)
    assert [p[0] % block for p in parts] == [0, 0, 0] and sum(n for _, n in parts) == len(data)
    path = tmp_path / "landing"
    path.write_bytes(b"")
    for start, n in reversed(parts):  # the last range first
        w = IncomingFile(path, len(data), cs, "x", start=start, end=start + n)
        for at in range(start, start + n, 40_000):
            w.write(at, data[at : min(at + 40_000, start + n)])
        w.finish()
        w.close()
    assert path.read_bytes() == data
    # A flipped byte in a middle range fails that range's block, by its index in the file.
    start, n = parts[1]
    bad = bytearray(data[start : start + n])
    bad[block + 7] ^= 1
    w = IncomingFile(path, len(data), cs, "x", start=start, end=start + n)
    with pytest.raises(ChecksumMismatch, match=f"block {start // block + 1} "):
        w.write(start, bytes(bad))
    w.close()
    with pytest.raises(InvalidArgument, match="does not fall on blocks"):
        IncomingFile(path, len(data), cs, "x", start=block // 2)


class _FirewalledPeer:
    """A PeerClient stand-in whose peer grants a bulk transfer on a port this node cannot
    reach, and serves FetchFile."""

    node_id = "n1"

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.fetched: list[tuple[int, int]] = []

    def grant(
        self, node: str, ns: str, cid: str, name: str, offset: int, length: int, background: bool
    ) -> object:
        return object()

    def fetch_bulk(self, node: str, ticket: object) -> Iterator[tuple[int, bytes]]:
        raise PeerCallError(node, "BulkFetch", CANNOT_CONNECT, "cannot connect to 10.0.0.9:4000")
        yield (0, b"")  # pragma: no cover

    def holdings(self, node: str, ns: str, cid: str) -> Holdings:
        return Holdings(True, frozenset({"x"}))

    def fetch(
        self, node: str, ns: str, cid: str, name: str, offset: int = 0, length: int = 0
    ) -> Iterator[tuple[int, bytes]]:
        self.fetched.append((offset, length))
        yield 0, self.data


def test_a_bulk_port_out_of_reach_falls_back_to_fetchfile() -> None:
    data = b"abc" * 1000
    client = _FirewalledPeer(data)
    f = FileRecord(name="x", rank=0, size=len(data), checksums=checksum_bytes(data))
    source = PeerSource(client, "n0")  # type: ignore[arg-type]
    assert b"".join(d for _, d in source.chunks("ns", "step-1", f)) == data
    assert client.fetched == [(0, 0)]
