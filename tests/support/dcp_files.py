"""Real DCP checkpoints on disk for persistent-tier tests, written by stock FileSystemWriter.

`save_checkpoint` writes one rank's checkpoint (tensors incl. bf16 and int64, and BYTE_IO
items); `save_two_rank_checkpoint` builds a 2-rank-shaped one (``__0_0.distcp`` and
``__1_0.distcp`` under one `.metadata`) from two single-process saves, so a test can load
a multi-file checkpoint in one process without a process group.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from tierckpt.checksum import BlockChecksums, checksum_bytes
from tierckpt.memory_files import VerifiedFile

from tests.support.state_dicts import assert_state_equal  # the one comparison, re-exported

__all__ = [
    "BLOCK_SIZE",
    "SavedCheckpoint",
    "assert_state_equal",
    "load_target",
    "make_state",
    "save_checkpoint",
    "save_two_rank_checkpoint",
]

BLOCK_SIZE = 4096  # small blocks: every file spans many, items straddle boundaries


def make_state(seed: int = 0, prefix: str = "model") -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        prefix: {
            "w": torch.randn(64, 33, generator=g),
            "big": torch.randn(300, 257, generator=g),
            "b": torch.randn(257, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 1 << 40, (17,), generator=g),
        },
        f"{prefix}_extra": {"step": 1234 + seed, "names": ["a", "b", seed], "cfg": {"lr": 0.1}},
    }


def load_target(state: Any) -> Any:
    """A state dict of the same structure whose values all differ from `state`'s."""
    if isinstance(state, dict):
        return {k: load_target(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, -7)
    return None


@dataclass(frozen=True)
class SavedCheckpoint:
    directory: Path
    state: dict[str, Any]

    @property
    def metadata(self) -> bytes:
        return (self.directory / ".metadata").read_bytes()

    @property
    def data_names(self) -> list[str]:
        return sorted(p.name for p in self.directory.glob("*.distcp"))

    def data(self, name: str) -> bytes:
        return (self.directory / name).read_bytes()

    def files(self) -> dict[str, bytes]:
        """Every file of the save by name, `.metadata` included (what a raw save sends)."""
        return {p.name: p.read_bytes() for p in sorted(self.directory.iterdir()) if p.is_file()}

    def checksums(self, name: str) -> BlockChecksums:
        return checksum_bytes(self.data(name), block_size=BLOCK_SIZE)

    def verified(self, name: str) -> VerifiedFile:
        path = self.directory / name
        return VerifiedFile(
            str(path), path.stat().st_size, self.checksums(name), what=f"test file {name}"
        )


def save_checkpoint(
    directory: Path, state: dict[str, Any] | None = None, thread_count: int = 1
) -> SavedCheckpoint:
    state = make_state() if state is None else state
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), thread_count=thread_count))
    return SavedCheckpoint(directory, state)


def save_two_rank_checkpoint(directory: Path) -> SavedCheckpoint:
    """Two ranks' files under one `.metadata`: rank 1's items live in ``__1_0.distcp``."""
    parts = [
        save_checkpoint(directory / f"part{r}", make_state(seed=r, prefix=f"rank{r}"))
        for r in (0, 1)
    ]
    directory.mkdir(parents=True, exist_ok=True)
    merged = pickle.loads(parts[0].metadata)
    other = pickle.loads(parts[1].metadata)
    merged.state_dict_metadata.update(other.state_dict_metadata)
    merged.planner_data.update(other.planner_data)
    for key, info in other.storage_data.items():
        merged.storage_data[key] = dataclasses.replace(info, relative_path="__1_0.distcp")
    (directory / "__0_0.distcp").write_bytes(parts[0].data("__0_0.distcp"))
    (directory / "__1_0.distcp").write_bytes(parts[1].data("__0_0.distcp"))
    (directory / ".metadata").write_bytes(pickle.dumps(merged))
    return SavedCheckpoint(directory, {**parts[0].state, **parts[1].state})
