"""`tierckpt://` as an fsspec filesystem: path grammar, registration, and how fsspec calls
map to the catalog, against the real daemon service (catalog + gRPC) in this process.

Saves and loads here are stock `dcp.save`/`dcp.load` in one process with a URL id; the
multi-rank jobs (FSDP2, async executors, resharding) are in
tests/integration/test_fsspec_dcp.py.
"""

from __future__ import annotations

import io
import os
import pickle
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import (
    ChecksumMismatch,
    DaemonUnavailable,
    InvalidName,
    MemoryBudgetExceeded,
    UnsafeMetadata,
)
from tierckpt.fsspec_fs import TierckptFileSystem, TierPath, parse_path
from tierckpt.names import check_checkpoint_id, check_file_name, check_namespace
from tierckptd.catalog import Catalog
from tierckptd.memory.tier import MemoryTier
from tierckptd.rpc.health import Health
from tierckptd.rpc.servers import start_servers
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.daemon_parts import daemon_service

ROOT = Path(__file__).resolve().parents[3]
MiB = 1 << 20


# --- grammar ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("tierckpt://", TierPath()),
        ("tierckpt://run7", TierPath("run7")),
        ("tierckpt://run7/", TierPath("run7")),
        ("tierckpt://run7/step-000100", TierPath("run7", "step-000100")),
        ("tierckpt://run7/epoch=0-step=100", TierPath("run7", "epoch=0-step=100")),
        ("run7/step-1/__0_0.distcp", TierPath("run7", "step-1/__0_0.distcp")),
        ("tierckpt://run7/step-1/.metadata.tmp", TierPath("run7", "step-1/.metadata.tmp")),
        ("tierckpt://run7/latest/.metadata", TierPath("run7", "latest/.metadata")),
        ("tierckpt://team/run1/step-10/.metadata", TierPath("team", "run1/step-10/.metadata")),
    ],
)
def test_paths_parse_into_namespace_and_path(url: str, parsed: TierPath) -> None:
    assert parse_path(url) == parsed
    assert parse_path(url).name == TierckptFileSystem._strip_protocol(url)


def test_a_file_is_the_last_part_of_a_path_under_its_checkpoint_folders() -> None:
    assert parse_path("tierckpt://team/run1/step-10/__0_0.distcp").as_file() == (
        "run1/step-10",
        "__0_0.distcp",
    )
    assert parse_path("tierckpt://team/step-1/.metadata").as_file() == ("step-1", ".metadata")
    assert parse_path("tierckpt://team/run1/step-10").checkpoint_id == "run1/step-10"
    with pytest.raises(IsADirectoryError):
        parse_path("tierckpt://team/step-1").as_file()
    with pytest.raises(InvalidName):  # a hidden folder is no checkpoint folder
        parse_path("tierckpt://team/.hidden/step-1/.metadata").as_file()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("tierckpt://run7/" + "/".join(["d"] * 10), "too deep"),
        ("tierckpt://run7/../other", "checkpoint id '..'"),
        ("tierckpt://run7/a/./b", "checkpoint id '.'"),
        ("tierckpt://run7//x", "checkpoint id ''"),
        ("tierckpt:///run7", "namespace ''"),
        ("tierckpt://run=7/step-1", "namespace 'run=7'"),  # `=` only in checkpoint ids
        ("tierckpt://run7/step-1/.a=b", "file name '.a=b'"),
        ("tierckpt://run7/step 1", "checkpoint id 'step 1'"),
    ],
)
def test_bad_paths_are_refused_naming_the_part(url: str, message: str) -> None:
    with pytest.raises(InvalidName, match=message):
        parse_path(url)


@pytest.mark.parametrize("value", ["epoch=0-step=100", "=", "a==b", "step=..", "last=.ckpt"])
def test_equals_sign_is_allowed_in_checkpoint_ids_only(value: str) -> None:
    assert check_checkpoint_id(value) == value
    for check in (check_namespace, check_file_name):
        with pytest.raises(InvalidName, match=r"\[A-Za-z0-9._-\]"):
            check(value)


@pytest.mark.parametrize("value", ["=/..", "../=", "a=b/", "=\n", "=\x00"])
def test_equals_sign_enables_no_path_tricks(value: str) -> None:
    with pytest.raises(InvalidName, match=r"\[A-Za-z0-9._-\] and '='"):
        check_checkpoint_id(value)


def test_entry_point_registers_the_protocol() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    specs = project["project"]["entry-points"]["fsspec.specs"]
    assert specs == {"tierckpt": "tierckpt.fsspec_fs:TierckptFileSystem"}
    assert fsspec.get_filesystem_class("tierckpt") is TierckptFileSystem


def test_filesystem_is_cheap_and_picklable_without_a_daemon(tmp_path: Path) -> None:
    # DCP instantiates it to validate every checkpoint id and pickles it into the PROCESS
    # executor's child: neither may talk to the daemon.
    fs, path = fsspec.url_to_fs("tierckpt://run7/step-1", daemon=f"unix://{tmp_path}/none")
    assert isinstance(fs, TierckptFileSystem) and path == "run7/step-1"
    clone = pickle.loads(pickle.dumps(fs))
    assert isinstance(clone, TierckptFileSystem)
    assert clone.client.address == f"unix://{tmp_path}/none"


def test_an_unreachable_daemon_is_an_error_not_a_missing_file(tmp_path: Path) -> None:
    fs = TierckptFileSystem(daemon=f"unix://{tmp_path}/none", skip_instance_cache=True)
    fs.client.timeout_s = 2.0
    with pytest.raises(DaemonUnavailable, match="not reachable"):
        fs.exists("tierckpt://run7/step-1/.metadata")


# --- against the daemon service ----------------------------------------------------------
@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Catalog]:
    """The real catalog and DaemonService on a unix socket; TIERCKPT_DAEMON points at it."""
    tier = MemoryTier(tmp_path / "mem")
    tier.open_layout()
    catalog = Catalog(tier, node_id="n0", failure_domain="r0", budget=64 * MiB, memory_keep_last=0)
    catalog.adopt()
    address = f"unix://{tmp_path}/d.sock"
    servers = start_servers(daemon_service(catalog), Health(), address, "")
    monkeypatch.setenv("TIERCKPT_DAEMON", address)
    try:
        yield catalog
    finally:
        servers.stop(0)
        tier.close()


def _state(seed: int, n: int = 1000) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=gen), "step": torch.tensor(seed), "extra": {"s": seed}}


def _empty(n: int = 1000) -> dict[str, Any]:
    return {"w": torch.zeros(n), "step": torch.tensor(-1), "extra": {"s": -1}}


def _fs() -> TierckptFileSystem:
    fs = fsspec.filesystem("tierckpt")
    assert isinstance(fs, TierckptFileSystem)
    return fs


def _assert_loads(url: str, expected: dict[str, Any], n: int = 1000) -> None:
    target = _empty(n)
    dcp.load(target, checkpoint_id=url)
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["step"], expected["step"])
    assert target["extra"] == expected["extra"]


def test_save_commit_listing_and_load(daemon: Catalog) -> None:
    fs = _fs()
    states = {cid: _state(i) for i, cid in enumerate(["step-000200", "epoch=0-step=100"])}
    for cid, state in states.items():
        assert not fs.exists(f"tierckpt://run7/{cid}/.metadata")
        dcp.save(state, checkpoint_id=f"tierckpt://run7/{cid}")
        assert fs.isfile(f"tierckpt://run7/{cid}/.metadata")

    # A namespace lists its committed checkpoints in commit order, as folders.
    assert fs.ls("tierckpt://run7", detail=False) == [
        "run7/step-000200",
        "run7/epoch=0-step=100",
    ]
    assert fs.ls("tierckpt://", detail=False) == ["run7"]
    entry = fs.info("tierckpt://run7/epoch=0-step=100")
    assert entry["type"] == "directory" and entry["state"] == "COMMITTED"
    assert entry["checkpoint_id"] == "epoch=0-step=100" and entry["files"] == 2
    files = fs.ls("tierckpt://run7/epoch=0-step=100")
    assert [f["name"] for f in files] == [
        "run7/epoch=0-step=100/.metadata",
        "run7/epoch=0-step=100/__0_0.distcp",
    ]
    assert sum(f["size"] for f in files) == entry["size"]
    assert fs.isdir("tierckpt://run7") and not fs.isfile("tierckpt://run7/step-000200")
    assert not fs.exists("tierckpt://run8") and not fs.exists("tierckpt://run7/step-9")
    assert not fs.exists("tierckpt://run7/step-000200/.metadata.tmp")

    for cid, state in states.items():
        _assert_loads(f"tierckpt://run7/{cid}", state)
    # `latest` is the newest commit, not the highest name.
    assert fs.info("tierckpt://run7/latest")["checkpoint_id"] == "epoch=0-step=100"
    _assert_loads("tierckpt://run7/latest", states["epoch=0-step=100"])
    assert daemon.reserved_bytes() == 0


def test_rm_maps_to_tierckpt_rm_and_protects_committed_files(daemon: Catalog) -> None:
    fs = _fs()
    for i in range(3):
        dcp.save(_state(i), checkpoint_id=f"tierckpt://run7/step-{i}")
    with pytest.raises(IsADirectoryError, match="recursive=True"):
        fs.rm("tierckpt://run7/step-0")
    with pytest.raises(PermissionError, match="committed checkpoint"):
        fs.rm("tierckpt://run7/step-0/__0_0.distcp")
    with pytest.raises(PermissionError, match="one by one"):
        fs.rm("tierckpt://run7", recursive=True)
    with pytest.raises(InvalidName, match="newest committed"):
        fs.rm("tierckpt://run7/latest", recursive=True)
    fs.rm(["tierckpt://run7/step-0", "tierckpt://run7/step-1"], recursive=True)
    assert fs.ls("tierckpt://run7", detail=False) == ["run7/step-2"]
    with pytest.raises(FileNotFoundError):
        fs.rm("tierckpt://run7/step-0", recursive=True)
    with pytest.raises(OSError, match="only DCP's .metadata.tmp -> .metadata"):
        fs.mv("tierckpt://run7/step-2", "tierckpt://run7/step-3")


def test_folders_list_resolve_and_remove_like_local_ones(daemon: Catalog) -> None:
    fs = _fs()
    ids = ["run1", "run1/step-10", "run1/step-20", "run1/sub/step-5", "run2/step-1"]
    for i, cid in enumerate(ids):
        fs.makedirs(f"tierckpt://team/{cid}", exist_ok=True)  # torchtitan's call: a no-op
        dcp.save(_state(i), checkpoint_id=f"tierckpt://team/{cid}")
    assert fs.ls("tierckpt://team", detail=False) == ["team/run1", "team/run2"]
    # A checkpoint that is also a folder lists its files and its sub-folders.
    assert fs.ls("tierckpt://team/run1", detail=False) == [
        "team/run1/.metadata",
        "team/run1/__0_0.distcp",
        "team/run1/step-10",
        "team/run1/step-20",
        "team/run1/sub",
    ]
    assert fs.info("tierckpt://team/run1")["checkpoint_id"] == "run1"
    sub = fs.info("tierckpt://team/run1/sub")
    assert sub["type"] == "directory" and "checkpoint_id" not in sub
    assert fs.info("tierckpt://team/run1/step-10")["checkpoint_id"] == "run1/step-10"
    assert fs.isfile("tierckpt://team/run1/sub/step-5/.metadata")
    assert fs.isfile("tierckpt://team/run1/__0_0.distcp")
    assert not fs.exists("tierckpt://team/run1/step-10/model.safetensors.index.json")
    assert not fs.exists("tierckpt://team/run1/step-30") and not fs.exists("tierckpt://team/run")
    with pytest.raises(FileNotFoundError):
        fs.ls("tierckpt://team/run3")
    _assert_loads("tierckpt://team/run1/sub/step-5", _state(3))

    with pytest.raises(IsADirectoryError, match="recursive=True"):
        fs.rm("tierckpt://team/run1/step-10")
    fs.rm("tierckpt://team/run1/step-10", recursive=True)
    assert fs.ls("tierckpt://team/run1/", detail=False)[-2:] == [
        "team/run1/step-20",
        "team/run1/sub",
    ]
    fs.rm("tierckpt://team/run1", recursive=True)  # the folder: every checkpoint in it
    assert [c.checkpoint_id for c in daemon.list_checkpoints("team")] == ["run2/step-1"]
    with pytest.raises(FileNotFoundError):
        fs.rm("tierckpt://team/run1", recursive=True)
    with pytest.raises(InvalidName):
        fs.rm("tierckpt://team/run2/../run1", recursive=True)


def test_a_committed_id_is_replaced_atomically_or_kept_immutable(daemon: Catalog) -> None:
    """DCP's default (overwrite=True) re-saves a committed id as a local folder would,
    but as a new generation: the old one loads until the new one commits; a re-save
    aborted midway leaves it; FsspecWriter(overwrite=False) refuses before a byte."""
    fs = _fs()
    dcp.save(_state(1), checkpoint_id="tierckpt://run7/step-1")
    first = daemon.get("run7", "step-1").sequence
    # A re-save under way (one file written, not committed): the old one is what loads.
    with fs.open("tierckpt://run7/step-1/__0_0.distcp", "wb") as f:
        f.write(b"half of a new generation")
    _assert_loads("tierckpt://run7/step-1", _state(1))
    fs.rm("tierckpt://run7/step-1/__0_0.distcp")  # DCP's error clean-up: the re-save aborts
    _assert_loads("tierckpt://run7/step-1", _state(1))
    assert daemon.get("run7", "step-1").sequence == first
    with pytest.warns(UserWarning, match="overwriting"):
        dcp.save(_state(2), checkpoint_id="tierckpt://run7/step-1")
    _assert_loads("tierckpt://run7/step-1", _state(2))
    assert [c.checkpoint_id for c in daemon.list_checkpoints("run7")] == ["step-1"]
    assert daemon.get("run7", "step-1").sequence > first
    writer = FsspecWriter("tierckpt://run7/step-1", overwrite=False)
    with pytest.raises(CheckpointException, match="already exists"):
        dcp.save(_state(3), storage_writer=writer)
    _assert_loads("tierckpt://run7/step-1", _state(2))  # untouched
    with pytest.raises(FileExistsError):
        fs.makedirs("tierckpt://run7/step-1", exist_ok=False)
    fs.makedirs("tierckpt://run7/step-1", exist_ok=True)
    with pytest.raises(InvalidName, match="newest committed"):
        fs.open("tierckpt://run7/latest/__0_0.distcp", "wb")
    with pytest.raises(ValueError, match="not 'ab'"):
        fs.open("tierckpt://run7/step-2/__0_0.distcp", "ab")


def test_writes_reserve_as_they_grow_and_a_full_budget_aborts_the_save(daemon: Catalog) -> None:
    fs = _fs()
    # 20 MiB in 1 MiB writes: more than the first chunk, so the reservation grows.
    with fs.open("tierckpt://big/step-1/__0_0.distcp", "wb") as f:
        for i in range(20):
            f.write(bytes([i]) * MiB)
        assert daemon.reserved_bytes() >= 20 * MiB
    assert daemon.used_bytes() >= 20 * MiB
    # 64 MiB budget: this file cannot fit; the error names the file, the save is gone.
    refused = pytest.raises(
        MemoryBudgetExceeded, match=r"tierckpt://big/step-2/__0_0.distcp.*budget"
    )
    with refused, fs.open("tierckpt://big/step-2/__0_0.distcp", "wb") as f:
        for _ in range(80):
            f.write(b"x" * MiB)
    assert [
        c.checkpoint_id for c in DaemonClient().list_checkpoints("big", include_uncommitted=True)
    ] == ["step-1"]
    # Left: step-1's unused chunk (it is not committed yet); step-2's went with the abort.
    assert daemon.reserved_bytes() < 20 * MiB


def test_reads_are_verified(daemon: Catalog) -> None:
    state = _state(5, 300_000)
    dcp.save(state, checkpoint_id="tierckpt://run7/step-5")
    entry = DaemonClient().get_checkpoint("run7", "step-5").file("__0_0.distcp")
    os.chmod(entry.local_path, 0o600)
    with open(entry.local_path, "r+b") as f:
        f.seek(entry.size // 2)
        byte = f.read(1)
        f.seek(entry.size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(BaseException, match="checksum mismatch") as e:
        dcp.load(_empty(300_000), checkpoint_id="tierckpt://run7/step-5")
    assert "ChecksumMismatch" in repr(e.value) or isinstance(e.value, ChecksumMismatch)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getcwd, ())


def test_a_metadata_that_is_not_plain_dcp_is_never_committed(daemon: Catalog) -> None:
    fs = _fs()
    with pytest.raises(UnsafeMetadata), fs.open("tierckpt://run7/step-1/.metadata.tmp", "wb") as f:
        f.write(pickle.dumps(_Evil()))
    assert DaemonClient().list_checkpoints("run7", include_uncommitted=True) == []


@pytest.mark.parametrize("keep", ["", "1"])
def test_crc32_is_off_only_while_a_data_file_is_written(
    daemon: Catalog, monkeypatch: pytest.MonkeyPatch, keep: str
) -> None:
    crc32 = torch.serialization.get_crc32_options
    monkeypatch.setenv("TIERCKPT_FSSPEC_CRC32", keep)
    fs = _fs()
    assert crc32()
    with fs.open("tierckpt://run7/step-1/__0_0.distcp", "wb") as data:
        data.write(b"x")
        with fs.open("tierckpt://run7/step-1/__1_0.distcp", "wb") as other:
            other.write(b"y")
        assert crc32() is bool(keep)  # still one data file open
        with fs.open("tierckpt://run7/step-1/meta.pt", "wb") as sidecar:
            sidecar.write(b"z")  # not a DCP data file: no change
            assert crc32() is bool(keep)
    assert crc32()
    # Streams that close in another order than they opened: the last one restores.
    first = fs.open("tierckpt://run7/step-3/__0_0.distcp", "wb")
    second = fs.open("tierckpt://run7/step-3/__1_0.distcp", "wb")
    first.close()
    assert crc32() is bool(keep)
    second.close()
    assert crc32()

    # What torch.save writes into such a stream (as DCP's writer thread does) has no CRC.
    with fs.open("tierckpt://run7/step-2/__0_0.distcp", "wb") as data:
        torch.save(torch.arange(4096.0), data)
    with fs.open("tierckpt://run7/step-2/.metadata", "wb") as meta:  # commits: readable
        meta.write(_metadata_naming("__0_0.distcp"))
    with fs.open("tierckpt://run7/step-2/__0_0.distcp", "rb") as f:
        records = zipfile.ZipFile(io.BytesIO(f.read())).infolist()
    assert records and all((r.CRC != 0) is bool(keep) for r in records if r.file_size)
    assert crc32()


def _metadata_naming(*files: str) -> bytes:
    """A plain DCP `.metadata` whose storage data names `files`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    md = Metadata(
        state_dict_metadata={f: BytesStorageMetadata() for f in files},
        storage_data={MetadataIndex(f): _StorageInfo(f, 0, 1) for f in files},
    )
    return pickle.dumps(md)
