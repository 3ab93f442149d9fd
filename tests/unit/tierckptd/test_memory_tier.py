from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from tierckpt.checksum import checksum_bytes
from tierckpt.errors import CheckpointIncomplete, InvalidName
from tierckptd.memory.pool import Segment, WarmPool
from tierckptd.memory.tier import MemoryTier, MemoryTierLocked, UnsafePath
from tierckptd.memory.verify import verify_files
from tierckptd.model import FileRecord


def test_layout_modes_and_exclusive_lock(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path / "mem")
    tier.open_layout()
    for d in (tier.root, tier.data_root, tier.manifest_root, tier.pool_dir):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o2750  # not group-writable (audit H1)
    other = MemoryTier(tmp_path / "mem")
    with pytest.raises(
        MemoryTierLocked, match=rf"in use by another tierckptd \(pid {os.getpid()}\)"
    ):
        other.open_layout()
    tier.close()
    other.open_layout()
    other.close()


def test_create_file_is_exclusive_and_group_writable(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path)
    path = tier.file_path("run", "s", "f")
    tier.create_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    with pytest.raises(FileExistsError):
        tier.create_file(path)


def test_pick_segment_rules(tmp_path: Path) -> None:
    pool = WarmPool(MemoryTier(tmp_path))
    pool.segments = [
        Segment(tmp_path / "s0", 120, "__0_0.distcp", "run"),
        Segment(tmp_path / "s1", 90, None, "run"),
        Segment(tmp_path / "s2", 60, None, ""),
        Segment(tmp_path / "s3", 500, ".metadata", "run"),
        Segment(tmp_path / "s4", 95, "__1_0.distcp", "other"),
    ]
    same = pool.pick_segment("__0_0.distcp", 100, "run")
    assert same is not None and same.size == 120  # same name, within 1.25x
    best = pool.pick_segment("__1_0.distcp", 100, "run")
    assert best is not None and best.size == 90  # largest that fits, of this namespace
    assert pool.pick_segment("__0_0.distcp", 50, "run") is None
    assert pool.pick_segment(".metadata", 100, "run") is not None
    assert pool.pick_segment(".metadata", 100, "run").size == 90  # type: ignore[union-attr]
    # Another namespace gets only fresh segments, never "run"'s old pages.
    fresh = pool.pick_segment("__0_0.distcp", 100, "job2")
    assert fresh is not None and fresh.size == 60


def _outside(tmp_path: Path) -> Path:
    """A daemon-owned secret outside the memory dir (a token, a TLS key)."""
    secret = tmp_path / "outside" / "token"
    secret.parent.mkdir()
    secret.write_bytes(b"s" * 30)
    secret.chmod(0o600)
    return secret


def test_paths_never_leave_the_root(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path / "mem")
    for bad in ("../x", "/abs", "a/b", "..", ".", "", "x" * 129, "a\x00b"):
        with pytest.raises(InvalidName):
            tier.data_dir(bad, "s")
        if bad != "a/b":  # a folder path is a checkpoint id
            with pytest.raises(InvalidName):
                tier.manifest_path("run", bad)
        with pytest.raises(InvalidName):
            tier.file_path("run", "s", bad)
    assert tier.file_path("run", "s", ".metadata") == tmp_path / "mem/data/run/s/.metadata"


@pytest.mark.parametrize(
    "checkpoint_id", ["run1/step-10", "a/b/c/d/e/f/g/h", "x" * 128 + "/" + "y" * 71]
)
def test_a_folder_id_is_one_directory_under_its_namespace(
    tmp_path: Path, checkpoint_id: str
) -> None:
    """A folder path never nests directories here: one checkpoint's dir never holds
    another's, and every derived name (manifest, its tmp and quarantine names) fits
    NAME_MAX."""
    tier = MemoryTier(tmp_path / "mem")
    flat = checkpoint_id.replace("/", "+")
    assert tier.data_dir("team", checkpoint_id) == tier.data_root / "team" / flat
    assert tier.file_path("team", checkpoint_id, ".metadata").parent.parent == (
        tier.data_root / "team"
    )
    manifest = tier.manifest_path("team", checkpoint_id)
    assert manifest == tier.manifest_root / "team" / f"{flat}.json"
    assert len(f".{manifest.name}.tmp-{'0' * 16}") <= 255
    assert len(f"{manifest.name}.corrupt") <= 255
    for bad in ("run1/..", "../../etc", "run1/./x", "run1/.hidden", "/".join("abcdefghi")):
        with pytest.raises(InvalidName):
            tier.data_dir("team", bad)
        with pytest.raises(InvalidName):
            tier.manifest_path("team", bad)


def test_symlinked_directories_and_files_are_refused(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path / "mem")
    tier.open_layout()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tier.data_root / "run").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="symbolic link"):
        tier.create_file(tier.file_path("run", "s", "f"))
    with pytest.raises(UnsafePath):
        tier.make_dir(tier.data_dir("run", "s"))
    assert list(elsewhere.iterdir()) == []
    # A data file replaced by a link to a secret: sealing, pooling and verifying refuse
    # it, and the secret keeps its mode, bytes and size.
    secret = _outside(tmp_path)
    path = tier.file_path("job", "s", "f")
    tier.create_file(path)
    path.unlink()
    path.symlink_to(secret)
    with pytest.raises(UnsafePath, match="symbolic link"):
        tier.seal_file(path)
    pool = WarmPool(tier)
    assert pool.to_pool(path, "f", "job") is None
    assert not os.path.lexists(path) and pool.segments == []
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.read_bytes() == b"s" * 30
    tier.remove_checkpoint_dir("run", "s")
    assert elsewhere.exists()
    tier.close()


def test_seal_refuses_a_file_still_open_for_writing(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path / "mem")
    tier.open_layout()
    path = tier.file_path("run", "s", "f")
    tier.create_file(path)
    fd = os.open(path, os.O_WRONLY)
    os.write(fd, b"abc")
    with pytest.raises(CheckpointIncomplete, match="close the file before CommitFile"):
        tier.seal_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660  # still the writer's
    os.close(fd)

    def three_bytes(st: os.stat_result) -> None:
        assert st.st_size == 3

    tier.seal_file(path, three_bytes)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o440
    tier.close()


def test_adopt_pool_keeps_only_regular_segments(tmp_path: Path) -> None:
    secret = _outside(tmp_path)
    tier = MemoryTier(tmp_path / "mem")
    tier.open_layout()
    (tier.pool_dir / "seg-1@run").write_bytes(b"x" * 10)
    (tier.pool_dir / "seg-2@").write_bytes(b"y" * 20)
    (tier.pool_dir / "seg-3@run").symlink_to(secret)
    (tier.pool_dir / "seg-4").write_bytes(b"z")  # an older version's: tenant unknown
    (tier.pool_dir / "junk").mkdir()
    (tier.pool_dir / "junk" / "a").write_bytes(b"a")
    pool = WarmPool(tier)
    pool.adopt_pool()
    assert sorted((s.path.name, s.namespace, s.size) for s in pool.segments) == [
        ("seg-1@run", "run", 10),
        ("seg-2@", "", 20),
    ]
    assert sorted(p.name for p in tier.pool_dir.iterdir()) == ["seg-1@run", "seg-2@"]
    assert secret.read_bytes() == b"s" * 30
    # New segments never reuse a number still on disk.
    assert pool.new_prewarm_path()[1].name == "seg-3@"
    tier.close()


def test_open_layout_fixes_group_writable_dirs_and_planted_links(tmp_path: Path) -> None:
    root = tmp_path / "mem"
    root.mkdir()
    (root / "data").mkdir()
    os.chmod(root / "data", 0o2770)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "manifests").symlink_to(elsewhere)
    tier = MemoryTier(root)
    tier.open_layout()
    assert stat.S_IMODE(os.stat(root / "data").st_mode) == 0o2750
    assert (root / "manifests").is_dir() and not (root / "manifests").is_symlink()
    assert elsewhere.exists()
    tier.close()


def test_verify_files_reports_every_bad_file_or_stops_at_the_first(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path / "mem")
    tier.open_layout()
    files = []
    for name, data, stored in (("a", b"a" * 3000, b"a" * 3000), ("b", b"b" * 10, b"B" * 10)):
        path = tier.file_path("run", "s", name)
        tier.create_file(path)
        path.write_bytes(stored)
        files.append(FileRecord(name, 0, len(data), checksum_bytes(data, block_size=1024)))
    files.append(FileRecord("c", 0, 5, checksum_bytes(b"c" * 5), held=False))  # a peer's
    files.append(FileRecord("d", 0, 5, checksum_bytes(b"d" * 5)))  # missing here
    result = verify_files(tier, "run", "s", files)
    assert not result.ok and result.verified_bytes == 3000
    assert result.problems == {"b": "checksum mismatch in block 0", "d": "file is missing"}
    assert result.corrupt_files == ["b", "d"]
    first = verify_files(tier, "run", "s", files[1:], seal=True, stop_at_first=True)
    assert first.corrupt_files == ["b"]
    sealed = verify_files(tier, "run", "s", files[:1], seal=True)
    assert sealed.ok and stat.S_IMODE(os.stat(tier.file_path("run", "s", "a")).st_mode) == 0o440
    tier.close()
