"""What the save path writes, read back with stock tools: every item is a torch.save record
that torch.load and FileSystemReader read, written without torch's CRC32 in every writer
thread (our xxh3 blocks cover the bytes), and the committed block checksums match the
file's final bytes, also when the file reused a longer warm segment."""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt.checksum import checksum_bytes
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo

from tests.support.backends import Tiered
from tests.support.cli import ls_json

pytestmark = pytest.mark.integration

NS = "fmt"


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB: spans whole and partial blocks
        "mid": torch.randn(1000, 77, generator=g).to(torch.bfloat16),
        "ints": torch.randint(0, 1 << 30, (4097,), generator=g),
        "tiny": torch.tensor([seed], dtype=torch.float64),
        "extra": {"step": seed, "name": "run"},
    }


@pytest.mark.timeout(120)
def test_saved_items_are_plain_torch_save_records_without_crc(daemon: Any) -> None:
    for step in range(3):  # later saves recycle the earlier ones' files as warm segments
        with pytest.warns(UserWarning, match="single process"):
            Tiered(NS, daemon.address).save(_state(step), f"step-{step:06d}")
    directory = daemon.data_dir(NS, "step-000002")
    metadata = FileSystemReader(str(directory)).read_metadata()
    expected = _state(2)
    seen = set()
    for index, info in metadata.storage_data.items():
        assert isinstance(info, _StorageInfo)
        data = (directory / info.relative_path).read_bytes()
        blob = data[info.offset : info.offset + info.length]
        if index.fqn.startswith("extra"):
            continue  # BYTE_IO items are pickles, not zip records
        records = zipfile.ZipFile(io.BytesIO(blob)).infolist()
        # torch's CRC switch is thread-local: zero CRCs prove every writer thread skipped it.
        assert [r.CRC for r in records] == [0] * len(records), (index.fqn, info.relative_path)
        loaded = torch.load(io.BytesIO(blob), weights_only=True)
        assert torch.equal(loaded, expected[index.fqn]), index.fqn
        seen.add(index.fqn)
    assert seen == {"big", "mid", "ints", "tiny"}
    assert len({i.relative_path for i in metadata.storage_data.values()}) == 2  # 2 threads

    # Stock DCP reads the committed files as they are.
    target: dict[str, Any] = {
        k: torch.zeros_like(v) for k, v in expected.items() if isinstance(v, torch.Tensor)
    }
    target["extra"] = {"step": -1, "name": ""}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(target, storage_reader=FileSystemReader(str(directory)))
    for key, value in expected.items():
        assert torch.equal(value, target[key]) if key != "extra" else value == target[key], key

    # The committed checksums are those of each file's final bytes (no stale tail).
    rows = {r["id"]: r for r in ls_json(daemon.address, NS)}
    assert rows["step-000002"]["state"] == "COMMITTED"
    doc = json.loads(daemon.manifest_path(NS, "step-000002").read_text())
    assert {f["name"] for f in doc["files"]} == {p.name for p in directory.iterdir()}
    for entry in doc["files"]:
        data = (directory / entry["name"]).read_bytes()
        assert entry["size"] == len(data)
        sums = checksum_bytes(data, entry["block_size"])
        assert [sums.digest(i).hex() for i in range(sums.block_count)] == entry["block_digests"]
