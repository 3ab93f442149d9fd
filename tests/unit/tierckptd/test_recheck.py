"""`peers.recheck.Rechecker`: a peer's ReportCorrupt is acted on only by this node's own
hash, one re-check at a time, never twice for a file within the quiet window."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tierckpt.checksum import BlockChecksums, checksum_bytes
from tierckpt.errors import CheckpointNotFound
from tierckptd.model import FileRecord
from tierckptd.peers.recheck import Rechecker

from tests.support.waiting import wait_until

DATA = bytes(range(256)) * 4096 + b"tail"


class Node:
    """Real files on disk, a catalog view of them and what the re-checker reported."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.records: dict[str, FileRecord] = {}
        self.dropped: list[tuple[str, str]] = []
        self.hashed: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.now = 0.0

    def hold(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.write_bytes(data)
        self.records[name] = FileRecord(name, 0, len(DATA), checksum_bytes(DATA, 1 << 16))
        return path

    def files(self, namespace: str, checkpoint_id: str, name: str) -> tuple[FileRecord, str]:
        if name not in self.records:
            raise CheckpointNotFound(f"no {name}")
        path = self.root / name
        return self.records[name], str(path) if path.exists() else ""

    def verify(self, path: Path, size: int, checksums: BlockChecksums) -> tuple[bool, str]:
        self.gate.wait(10)
        self.hashed.append(path.name)
        data = path.read_bytes()
        ok = len(data) == size and checksum_bytes(data, checksums.block_size) == checksums
        return ok, "" if ok else "checksum mismatch"

    def corrupt(
        self, namespace: str, checkpoint_id: str, name: str, reason: str, where: str
    ) -> None:
        self.dropped.append((name, where))

    def rechecker(self) -> Rechecker:
        return Rechecker(
            self.files, self.verify, self.corrupt, node_id="me", quiet=10.0, clock=lambda: self.now
        )


def test_only_its_own_failing_hash_drops_a_copy(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.hold("good", DATA)
    bad = bytearray(DATA)
    bad[70_000] ^= 1
    node.hold("bad", bytes(bad))
    r = node.rechecker()
    assert r.report("ns", "c", "good", "liar")
    wait_until("re-checked", lambda: node.hashed == ["good"] and not r.busy, 5)
    assert node.dropped == []  # the report's word alone drops nothing
    assert r.report("ns", "c", "bad", "honest")
    wait_until("dropped", lambda: node.dropped == [("bad", "served")], 5)


def test_one_recheck_at_a_time_and_none_again_within_the_quiet_window(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.hold("a", DATA)
    node.hold("b", DATA)
    r = node.rechecker()
    node.gate.clear()  # the first re-check hangs in its hash
    assert r.report("ns", "c", "a", "p")
    assert not r.report("ns", "c", "a", "p")  # being re-checked
    assert not r.report("ns", "c", "b", "p")  # one at a time
    node.gate.set()
    wait_until("re-checked", lambda: not r.busy, 5)
    assert not r.report("ns", "c", "a", "p")  # re-checked just now
    node.now += 11.0
    assert r.report("ns", "c", "a", "p")
    wait_until("re-checked again", lambda: node.hashed == ["a", "a"] and not r.busy, 5)


def test_a_file_not_held_is_not_found(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.records["gone"] = FileRecord("gone", 0, 1, checksum_bytes(b"x"))
    r = node.rechecker()
    for name in ("unknown", "gone"):
        with pytest.raises(CheckpointNotFound):
            r.report("ns", "c", name, "p")
    assert node.hashed == []
