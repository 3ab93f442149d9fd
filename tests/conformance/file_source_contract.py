"""The `FileSource` contract, one abstract suite run against every tier.

Like fsspec's ``fsspec/tests/abstract``: `FileSourceContract` holds the cases, and each
``test_<tier>_source.py`` subclasses it with two fixtures, ``backend`` and
``other_backend`` (two independent stores of the same kind: two peer nodes, two
persistent roots), each a `Backend`. Nothing here knows a tier.

What is checked (server/tierckptd/restore.py's docstring is the contract):

- ``chunks`` gives the original bytes at increasing offsets, covering the file exactly,
  and a file of any size (empty, one byte, exactly one block, a short last block, many
  blocks, more than one read of the tier) lands bit-exact through a real `Restorer`
  into a fresh memory tier (another node's catalog and memory dir);
- a source installs nothing itself, holds no lock across a yield (two readers of one
  file interleave) and lets go of a read given up half way (the restorer stops at the
  first bad block); a corrupt local copy is repaired from it;
- a flipped byte in the source's copy is caught (by the source or where the bytes land):
  DATA_LOSS only when every copy found is corrupt, and nothing is installed;
- a lost copy is NOT_FOUND (`CheckpointNotFound`) from the source; when no source holds
  the file, the restore raises `CheckpointLost` (DATA_LOSS "checkpoint lost: ...", a
  `CheckpointNotFound`) naming every source tried;
- an outage is UNAVAILABLE (`TierUnavailable`, never DATA_LOSS) naming the source, the
  source itself raising `SourceUnavailable` with its name, and the same source object
  serves again once the service is back;
- with several sources the first valid copy lands, and the final error lists every
  source tried and why.
"""

from __future__ import annotations

import abc
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import (
    TIER_UNAVAILABLE_PREFIX,
    CheckpointLost,
    CheckpointNotFound,
    ChecksumMismatch,
    TierUnavailable,
)
from tierckptd.catalog import Catalog
from tierckptd.errors import SourceUnavailable
from tierckptd.model import CheckpointRecord, FileRecord, State
from tierckptd.restore import FileSource, Outcome, Restorer

from tests.support.source_nodes import MemoryNode, file_bytes, flip_byte

__all__ = [
    "BIG",
    "BLOCK",
    "OUTAGE_REPORTED_WITHIN",
    "Backend",
    "FileSourceContract",
    "RestoringNode",
    "expected_record",
    "files_of",
    "within",
]

BLOCK = 64 << 10  # the smallest block a peer accepts (model.MIN_BLOCK_SIZE)
ODD = "__0_0.distcp"  # several blocks, odd size: a short last block
EMPTY = "__1_0.distcp"
ONE_BLOCK = "__2_0.distcp"
ONE_BYTE = "__3_0.distcp"
MANY = "__4_0.distcp"  # many blocks, one byte into the next
BIG = "__5_0.distcp"  # more than one 8 MiB read of the persistent tier
SIZES = {
    ODD: 3 * BLOCK + 777,
    EMPTY: 0,
    ONE_BLOCK: BLOCK,
    ONE_BYTE: 1,
    MANY: 40 * BLOCK + 1,
}
ALL_SIZES = {**SIZES, BIG: (9 << 20) + 3}
OUTAGE_REPORTED_WITHIN = 20.0  # seconds: a source must give up on a dead tier, not hang
BACK_WITHIN = 15.0  # seconds the same source may take to serve again after an outage

# More reads given up than a peer admits from one node at once (MAX_PER_PEER = 12).
ABANDONED_READS = 16

T = TypeVar("T")
_namespaces = itertools.count()


def fresh_namespace() -> str:
    """A namespace no other test of this run uses: a backend may keep its store (a
    daemon, a bucket) across tests, and each test's checkpoints stay its own."""
    return f"conformance-{os.getpid()}-{next(_namespaces)}"


def only(*names: str) -> dict[str, int]:
    return {name: SIZES[name] for name in names}


def files_of(
    namespace: str, checkpoint_id: str, sizes: Mapping[str, int] = SIZES
) -> dict[str, bytes]:
    return {name: file_bytes(namespace, checkpoint_id, name, size) for name, size in sizes.items()}


def expected_record(name: str, data: bytes, owner: str = "") -> FileRecord:
    """A committed record of `data` as the memory tier writes it (block size BLOCK)."""
    return FileRecord(
        name=name,
        rank=0,
        size=len(data),
        checksums=checksum_bytes(data, block_size=BLOCK),
        owner_node=owner,
        held=False,
    )


class Backend(abc.ABC):
    """One store of a tier, driven by the suite: what a test can do to a real tier."""

    @abc.abstractmethod
    def store(
        self, namespace: str, checkpoint_id: str, files: Mapping[str, bytes]
    ) -> dict[str, FileRecord]:
        """Put `files` into the tier the way the system does (a save, a drain); returns
        their committed records (sizes and block checksums of BLOCK bytes)."""

    @abc.abstractmethod
    def source(self, catalog: Catalog) -> FileSource:
        """A FileSource reading this store, for the node whose memory tier is `catalog`."""

    @abc.abstractmethod
    def corrupt_byte(self, namespace: str, checkpoint_id: str, name: str, offset: int) -> None:
        """Flip one byte of the original file at `offset` in the stored copy."""

    @abc.abstractmethod
    def lose(self, namespace: str, checkpoint_id: str, name: str) -> None:
        """The stored copy is gone (deleted underneath the tier's own bookkeeping)."""

    @abc.abstractmethod
    def outage(self) -> None:
        """The tier cannot be asked any more (server stopped, endpoint refused)."""

    @abc.abstractmethod
    def restore_service(self) -> None:
        """The tier serves again, with what it held before the outage."""


class RestoringNode:
    """The node a restore lands on: its own catalog and memory dir, which knows the
    checkpoint's manifest (published by its coordinator) but holds none of its files."""

    def __init__(self, root: Path, node_id: str = "node-dest") -> None:
        self.node = MemoryNode(root, node_id, block_size=BLOCK)
        self.catalog = self.node.catalog
        self.ns = fresh_namespace()

    def publish(self, checkpoint_id: str, records: Mapping[str, FileRecord]) -> None:
        namespace = self.ns
        now = time.time()
        files = {
            name: FileRecord(
                name=name,
                rank=f.rank,
                size=f.size,
                checksums=f.checksums,
                owner_node=f.owner_node,
                replica_nodes=list(f.replica_nodes),
                held=False,
            )
            for name, f in records.items()
        }
        rec = CheckpointRecord(
            namespace, checkpoint_id, State.COMMITTED, now - 2, "", now - 1, 1, files=files
        )
        assert self.catalog.publish(rec)
        for name in files:
            assert self.catalog.file_view(namespace, checkpoint_id, name)[1] == ""

    def restorer(self, *sources: FileSource) -> Restorer:
        return Restorer(self.catalog, lambda ns, cid, f: list(sources))

    def assert_nothing_installed(self, checkpoint_id: str, name: str) -> None:
        namespace = self.ns
        _, path = self.catalog.file_view(namespace, checkpoint_id, name)
        assert path == "", f"{name} was installed: {path}"
        assert not self.catalog.tier.file_path(namespace, checkpoint_id, name).exists()
        assert not self.catalog.tier.incoming_path(namespace, checkpoint_id, name).exists()
        assert self.catalog.reserved_bytes() == 0, "an incoming copy still holds its bytes"

    def close(self) -> None:
        self.node.close()


def read_all(source: FileSource, namespace: str, checkpoint_id: str, f: FileRecord) -> bytes:
    """The source's bytes of `f`, checking the pieces' offsets on the way."""
    out = bytearray()
    for offset, data in source.chunks(namespace, checkpoint_id, f):
        assert offset == len(out), (
            f"{source.name}: piece at offset {offset} after {len(out)} bytes "
            "(pieces must come in order, without gaps or overlaps)"
        )
        out += data
    return bytes(out)


def within(seconds: float, fn: Callable[[], T], what: str) -> T:
    """Run `fn` on a thread; fail (instead of hanging the suite) past `seconds`."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, name="conformance", daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{what} did not finish within {seconds} s"
    if error:
        raise error[0]
    return result[0]


def ensure_local(
    node: RestoringNode, restorer: Restorer, checkpoint_id: str, name: str
) -> tuple[FileRecord, str]:
    return within(
        OUTAGE_REPORTED_WITHIN,
        lambda: restorer.ensure_local(node.ns, checkpoint_id, name),
        f"ensure_local of {name}",
    )


def assert_lands(
    node: RestoringNode, restorer: Restorer, checkpoint_id: str, data: bytes, name: str
) -> None:
    f, path = ensure_local(node, restorer, checkpoint_id, name)
    assert path and f.size == len(data)
    assert Path(path).read_bytes() == data
    assert node.catalog.file_view(node.ns, checkpoint_id, name)[1] == path
    assert f.checksums is not None
    ok, why = node.catalog.tier.verify_file(Path(path), f.size, f.checksums)
    assert ok, why


def raises_naming(
    kind: type[Exception],
    node: RestoringNode,
    restorer: Restorer,
    checkpoint_id: str,
    name: str,
    sources: Sequence[str],
) -> Exception:
    """The restore fails with exactly `kind` and the error names every source tried."""
    with pytest.raises(Exception) as caught:
        ensure_local(node, restorer, checkpoint_id, name)
    e = caught.value
    assert type(e) is kind, f"expected {kind.__name__}, got {type(e).__name__}: {e}"
    message = str(e)
    for source in ["memory", *sources]:
        assert source in message, f"{source!r} not named in: {message}"
    return e


class FileSourceContract:
    """The cases; a subclass provides the ``backend`` and ``other_backend`` fixtures."""

    @pytest.fixture
    def node(self, tmp_path: Path) -> Iterator[RestoringNode]:
        node = RestoringNode(tmp_path / "restoring-node")
        yield node
        node.close()

    def stored(
        self,
        backend: Backend,
        node: RestoringNode,
        checkpoint_id: str,
        sizes: Mapping[str, int] = SIZES,
    ) -> dict[str, bytes]:
        files = files_of(node.ns, checkpoint_id, sizes)
        records = backend.store(node.ns, checkpoint_id, files)
        assert set(records) == set(files)
        for name, data in files.items():
            want = expected_record(name, data)
            got = records[name]
            assert (got.size, got.checksums) == (want.size, want.checksums), name
        node.publish(checkpoint_id, records)
        return files

    # ---- bytes ------------------------------------------------------------------------

    def test_a_source_has_a_name_that_tells_it_apart(
        self, backend: Backend, other_backend: Backend, node: RestoringNode
    ) -> None:
        a, b = backend.source(node.catalog), other_backend.source(node.catalog)
        assert isinstance(a.name, str) and a.name.strip() and a.name != "memory"
        assert a.name != b.name, "two stores of one tier must be told apart in errors"

    def test_every_size_lands_bit_exact_through_the_restorer(
        self, backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", ALL_SIZES)
        restorer = node.restorer(backend.source(node.catalog))
        for name, data in files.items():
            assert_lands(node, restorer, "step-1", data, name)
        assert node.catalog.reserved_bytes() == 0
        # Memory first: a held file is not asked of the tier again, even when it is down.
        backend.outage()
        for name, data in files.items():
            _, path = ensure_local(node, restorer, "step-1", name)
            assert Path(path).read_bytes() == data

    def test_chunks_cover_the_file_exactly_at_increasing_offsets(
        self, backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", ALL_SIZES)
        source = backend.source(node.catalog)
        for name, data in files.items():
            f, _ = node.catalog.file_view(node.ns, "step-1", name)
            assert read_all(source, node.ns, "step-1", f) == data, name
            node.assert_nothing_installed("step-1", name)  # a source never installs

    def test_each_checkpoint_has_its_own_bytes(self, backend: Backend, node: RestoringNode) -> None:
        sizes = {ODD: SIZES[ODD]}
        first = self.stored(backend, node, "step-1", sizes)
        second = self.stored(backend, node, "step-2", sizes)
        assert first[ODD] != second[ODD]
        restorer = node.restorer(backend.source(node.catalog))
        assert_lands(node, restorer, "step-2", second[ODD], ODD)
        assert_lands(node, restorer, "step-1", first[ODD], ODD)

    def test_two_readers_of_one_file_interleave(
        self, backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", {MANY: SIZES[MANY]})
        source = backend.source(node.catalog)
        f, _ = node.catalog.file_view(node.ns, "step-1", MANY)

        def interleave() -> tuple[bytes, bytes]:
            outs = (bytearray(), bytearray())
            readers = [iter(source.chunks(node.ns, "step-1", f)) for _ in outs]
            live = [0, 1]
            while live:
                for i in list(live):
                    piece = next(readers[i], None)
                    if piece is None:
                        live.remove(i)
                        continue
                    assert piece[0] == len(outs[i])
                    outs[i].extend(piece[1])
            return bytes(outs[0]), bytes(outs[1])

        one, two = within(30, interleave, "two interleaved readers (a lock held across a yield?)")
        assert one == two == files[MANY]

    def test_a_corrupt_local_copy_is_repaired_from_the_source(
        self, backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", only(ODD))
        dropped: list[str] = []
        restorer = Restorer(
            node.catalog,
            lambda ns, cid, f: [backend.source(node.catalog)],
            on_corrupt_local=lambda ns, cid, name, why: dropped.append(name),
        )
        _, path = ensure_local(node, restorer, "step-1", ODD)
        flip_byte(path, SIZES[ODD] // 2)
        _, same = ensure_local(node, restorer, "step-1", ODD)  # no repair asked: as held
        assert same == path
        f, path = within(
            OUTAGE_REPORTED_WITHIN,
            lambda: restorer.ensure_local(node.ns, "step-1", ODD, repair=True),
            "repair",
        )
        assert dropped == [ODD]
        assert Path(path).read_bytes() == files[ODD]

    def test_reads_given_up_half_way_leave_the_source_serving(
        self, backend: Backend, node: RestoringNode
    ) -> None:
        # The restorer stops reading a source at the first bad block (the generator is
        # closed); a source must let go of what it holds for the read (a stream, an
        # admission slot, a file) so that the next restores are served.
        files = self.stored(backend, node, "step-1", {MANY: SIZES[MANY], ODD: SIZES[ODD]})
        source = backend.source(node.catalog)
        f, _ = node.catalog.file_view(node.ns, "step-1", MANY)
        for _ in range(ABANDONED_READS):
            reader = iter(source.chunks(node.ns, "step-1", f))
            offset, data = next(reader)
            assert offset == 0 and bytes(data) == files[MANY][: len(data)]
            getattr(reader, "close", lambda: None)()  # what a for loop's exit does
            del reader
        restorer = node.restorer(source)
        assert_lands(node, restorer, "step-1", files[MANY], MANY)
        assert_lands(node, restorer, "step-1", files[ODD], ODD)

    def test_concurrent_restores_of_one_file_share_one_copy(
        self, backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", {MANY: SIZES[MANY]})
        restorer = node.restorer(backend.source(node.catalog))
        results: list[tuple[FileRecord, str] | BaseException] = []

        def restore() -> None:
            try:
                results.append(restorer.ensure_local(node.ns, "step-1", MANY))
            except BaseException as e:
                results.append(e)

        threads = [threading.Thread(target=restore) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 4 and all(isinstance(r, tuple) for r in results), results
        paths = {r[1] for r in results if isinstance(r, tuple)}
        assert len(paths) == 1
        assert Path(paths.pop()).read_bytes() == files[MANY]
        assert restorer.file_locks_in_use() == 0

    # ---- corruption -------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("name", "offset"),
        [
            pytest.param(ONE_BYTE, 0, id="the-only-byte"),
            pytest.param(ONE_BLOCK, BLOCK - 1, id="last-byte-of-a-full-block"),
            pytest.param(MANY, 20 * BLOCK + 12345, id="a-middle-block"),
            pytest.param(ODD, SIZES[ODD] - 1, id="the-short-last-block"),
        ],
    )
    def test_a_flipped_byte_is_data_loss_and_nothing_is_installed(
        self, backend: Backend, node: RestoringNode, name: str, offset: int
    ) -> None:
        other = ODD if name != ODD else ONE_BYTE
        files = self.stored(backend, node, "step-1", only(name, other))
        backend.corrupt_byte(node.ns, "step-1", name, offset)
        source = backend.source(node.catalog)
        restorer = node.restorer(source)
        e = raises_naming(ChecksumMismatch, node, restorer, "step-1", name, [source.name])
        assert f"{source.name}: {Outcome.CORRUPT.value}" in str(e)
        node.assert_nothing_installed("step-1", name)
        # Read directly, the source says so (or, having found its copy corrupt, that it
        # holds none any more), or hands out bytes that differ.
        f, _ = node.catalog.file_view(node.ns, "step-1", name)
        try:
            got = read_all(source, node.ns, "step-1", f)
        except (ChecksumMismatch, CheckpointNotFound):
            pass
        else:
            assert got != files[name], "the corrupt copy read back as the original"
        # The other files of the checkpoint are untouched.
        assert_lands(node, restorer, "step-1", files[other], other)

    def test_a_corrupt_copy_then_a_good_one_lands_the_good_one(
        self, backend: Backend, other_backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", only(MANY))
        assert other_backend.store(node.ns, "step-1", files)
        backend.corrupt_byte(node.ns, "step-1", MANY, 7 * BLOCK)
        restorer = node.restorer(backend.source(node.catalog), other_backend.source(node.catalog))
        assert_lands(node, restorer, "step-1", files[MANY], MANY)

    def test_every_copy_corrupt_is_data_loss_naming_each(
        self, backend: Backend, other_backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", only(ODD))
        assert other_backend.store(node.ns, "step-1", files)
        backend.corrupt_byte(node.ns, "step-1", ODD, 0)
        other_backend.corrupt_byte(node.ns, "step-1", ODD, 2 * BLOCK + 5)
        a, b = backend.source(node.catalog), other_backend.source(node.catalog)
        e = raises_naming(
            ChecksumMismatch, node, node.restorer(a, b), "step-1", ODD, [a.name, b.name]
        )
        assert f"{a.name}: {Outcome.CORRUPT.value}" in str(e)
        assert f"{b.name}: {Outcome.CORRUPT.value}" in str(e)
        node.assert_nothing_installed("step-1", ODD)

    def test_a_corrupt_copy_and_a_missing_one_is_data_loss_naming_both(
        self, backend: Backend, other_backend: Backend, node: RestoringNode
    ) -> None:
        self.stored(backend, node, "step-1", only(ODD))
        backend.corrupt_byte(node.ns, "step-1", ODD, BLOCK)
        a, b = backend.source(node.catalog), other_backend.source(node.catalog)
        e = raises_naming(
            ChecksumMismatch, node, node.restorer(b, a), "step-1", ODD, [a.name, b.name]
        )
        assert f"{b.name}: {Outcome.MISSING.value}" in str(e)
        node.assert_nothing_installed("step-1", ODD)

    # ---- missing ----------------------------------------------------------------------

    def test_a_lost_copy_is_not_found_naming_the_source(
        self, backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", only(ODD, ONE_BLOCK))
        backend.lose(node.ns, "step-1", ODD)
        source = backend.source(node.catalog)
        restorer = node.restorer(source)
        e = raises_naming(CheckpointLost, node, restorer, "step-1", ODD, [source.name])
        assert f"{source.name}: {Outcome.MISSING.value}" in str(e)
        node.assert_nothing_installed("step-1", ODD)
        f, _ = node.catalog.file_view(node.ns, "step-1", ODD)
        with pytest.raises(CheckpointNotFound):
            read_all(source, node.ns, "step-1", f)
        assert_lands(node, restorer, "step-1", files[ONE_BLOCK], ONE_BLOCK)  # the others are

    def test_a_file_never_stored_is_not_found(self, backend: Backend, node: RestoringNode) -> None:
        self.stored(backend, node, "step-1", {ODD: SIZES[ODD]})
        source = backend.source(node.catalog)
        data = files_of(node.ns, "step-9", {ODD: SIZES[ODD]})[ODD]
        node.publish("step-9", {ODD: expected_record(ODD, data, owner="node-gone")})
        with pytest.raises(CheckpointNotFound):
            read_all(source, node.ns, "step-9", expected_record(ODD, data))
        raises_naming(CheckpointLost, node, node.restorer(source), "step-9", ODD, [source.name])
        node.assert_nothing_installed("step-9", ODD)

    def test_missing_everywhere_is_not_found_naming_each(
        self, backend: Backend, other_backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", only(MANY))
        assert other_backend.store(node.ns, "step-1", files)
        backend.lose(node.ns, "step-1", MANY)
        other_backend.lose(node.ns, "step-1", MANY)
        a, b = backend.source(node.catalog), other_backend.source(node.catalog)
        raises_naming(CheckpointLost, node, node.restorer(a, b), "step-1", MANY, [a.name, b.name])
        node.assert_nothing_installed("step-1", MANY)

    # ---- outages ----------------------------------------------------------------------

    def test_an_outage_is_unavailable_naming_the_source_then_it_serves_again(
        self, backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", only(ODD))
        source = backend.source(node.catalog)
        restorer = node.restorer(source)
        backend.outage()
        started = time.monotonic()
        e = raises_naming(TierUnavailable, node, restorer, "step-1", ODD, [source.name])
        assert str(e).startswith(f"{TIER_UNAVAILABLE_PREFIX}{source.name}"), str(e)
        assert time.monotonic() - started < OUTAGE_REPORTED_WITHIN
        node.assert_nothing_installed("step-1", ODD)
        f, _ = node.catalog.file_view(node.ns, "step-1", ODD)
        with pytest.raises(SourceUnavailable) as down:
            within(OUTAGE_REPORTED_WITHIN, lambda: read_all(source, node.ns, "step-1", f), "chunks")
        assert down.value.source == source.name
        backend.restore_service()
        # The same source object serves again (a client retries UNAVAILABLE).
        deadline = time.monotonic() + BACK_WITHIN
        while True:
            try:
                assert_lands(node, restorer, "step-1", files[ODD], ODD)
                break
            except TierUnavailable:
                assert time.monotonic() < deadline, "the source did not come back"
                time.sleep(0.2)
        assert read_all(source, node.ns, "step-1", f) == files[ODD]

    def test_an_outage_and_a_corrupt_copy_is_unavailable_not_data_loss(
        self, backend: Backend, other_backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", only(ODD))
        assert other_backend.store(node.ns, "step-1", files)
        backend.corrupt_byte(node.ns, "step-1", ODD, 3)
        other_backend.outage()
        a, b = backend.source(node.catalog), other_backend.source(node.catalog)
        e = raises_naming(
            TierUnavailable, node, node.restorer(a, b), "step-1", ODD, [a.name, b.name]
        )
        assert f"{a.name}: {Outcome.CORRUPT.value}" in str(e)
        assert f"{b.name}: {Outcome.UNAVAILABLE.value}" in str(e)
        node.assert_nothing_installed("step-1", ODD)

    def test_an_outage_then_a_good_copy_lands_the_good_one(
        self, backend: Backend, other_backend: Backend, node: RestoringNode
    ) -> None:
        files = self.stored(backend, node, "step-1", only(ONE_BLOCK))
        assert other_backend.store(node.ns, "step-1", files)
        backend.outage()
        a, b = backend.source(node.catalog), other_backend.source(node.catalog)
        assert_lands(node, node.restorer(a, b), "step-1", files[ONE_BLOCK], ONE_BLOCK)
