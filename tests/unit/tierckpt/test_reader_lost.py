"""The client side of LOST: the reader refuses a LOST checkpoint with `CheckpointLost`
(naming its files and the nodes that held them), a `checkpoint_id=None` load says which
newer ones it skipped, and `tierckpt ls` says why a LOST one cannot be loaded.

The daemon is a stub here: what it answers is what tests/unit/tierckptd/test_lost_state.py
and tests/integration/test_lost_state.py check against real daemons."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import pytest
from tierckpt.cli import _cmd_ls
from tierckpt.daemon_client import CheckpointInfo, FileEntry
from tierckpt.errors import CHECKPOINT_LOST_PREFIX, CheckpointLost
from tierckpt.names import METADATA_FILE
from tierckpt.storage_reader import TieredStorageReader
from torch.distributed.checkpoint.metadata import Metadata

NS = "run"


def _entry(name: str, owner: str, replicas: tuple[str, ...] = ()) -> FileEntry:
    return FileEntry(name, 4, None, 0, owner, replicas, "")


def _info(
    cid: str, seq: int, state: str = "COMMITTED", lost: tuple[str, ...] = ()
) -> CheckpointInfo:
    files = (_entry(METADATA_FILE, "n0"), _entry("__1_0.distcp", "n1", ("n2",)))
    return CheckpointInfo(
        NS, cid, state, 8, 2, 1.0, float(seq), seq, (), False, files, lost_files=lost
    )


class StubDaemon:
    """Answers GetCheckpoint and ListCheckpoints as a daemon would."""

    def __init__(self, *rows: CheckpointInfo) -> None:
        self.rows = list(rows)

    def get_checkpoint(
        self, namespace: str, checkpoint_id: str | None = None, *, verified: bool = False
    ) -> CheckpointInfo:
        assert not verified  # these loads ask for the newest committed
        if checkpoint_id:
            return next(r for r in self.rows if r.checkpoint_id == checkpoint_id)
        return max((r for r in self.rows if r.state != "LOST"), key=lambda r: r.sequence)

    def list_checkpoints(self, namespace: str, **kwargs: Any) -> list[CheckpointInfo]:
        return list(self.rows)


def _reader(daemon: StubDaemon) -> TieredStorageReader:
    reader = TieredStorageReader(NS, daemon="unix:///nonexistent.sock")
    reader.client = daemon  # type: ignore[assignment]
    return reader


def test_loading_a_lost_checkpoint_names_its_files_and_holders() -> None:
    reader = _reader(StubDaemon(_info("s2", 2, "LOST", ("__1_0.distcp",))))
    reader.reset("s2")
    with pytest.raises(CheckpointLost) as e:
        reader.set_up_storage_reader(Metadata(state_dict_metadata={}), True)
    message = str(e.value)
    assert message.startswith(CHECKPOINT_LOST_PREFIX)
    assert "run/s2 is LOST" in message and "__1_0.distcp" in message
    assert "tried nodes n1, n2" in message and "checkpoint_id=None" in message


def test_a_lost_metadata_is_refused_before_it_is_read() -> None:
    reader = _reader(StubDaemon(_info("s2", 2, "LOST", (METADATA_FILE,))))
    reader.reset("s2")
    with pytest.raises(CheckpointLost, match="no copy of .metadata"):
        reader.read_metadata()


def test_newest_skips_lost_ones_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    daemon = StubDaemon(_info("s1", 1), _info("s2", 2), _info("s3", 3, "LOST", ("__1_0.distcp",)))
    reader = _reader(daemon)
    reader.reset(None)
    with caplog.at_level(logging.INFO, logger="tierckpt"):
        info = reader._checkpoint()
    assert info.checkpoint_id == "s2" and reader.checkpoint_id == "s2"
    assert reader.lost_newer == ("s3",)
    assert "restoring run/s2, the newest complete checkpoint: the newer s3 is LOST" in caplog.text
    reader.reset(None)  # nothing newer is lost: an info line, no warning
    daemon.rows.pop()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tierckpt"):
        reader._checkpoint()
    assert reader.lost_newer == () and "restoring run/s2, the newest checkpoint" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_ls_says_why_a_lost_checkpoint_cannot_be_loaded(capsys: pytest.CaptureFixture[str]) -> None:
    lost = tuple(f"__{i}_0.distcp" for i in range(7))
    daemon = StubDaemon(_info("s1", 1), _info("s2", 2, "LOST", lost))
    args = argparse.Namespace(namespace=NS, all=False, json=False)
    assert _cmd_ls(daemon, args) == 0  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "s2                       LOST" in out
    assert "s2 is LOST: no copy of __0_0.distcp, __1_0.distcp" in out and "and 2 more" in out
