"""Lightning 2.6 through `TierCheckpointIO`: a real `Trainer` on CPU against a real
tierckptd, killed with SIGKILL mid-run and resumed with ``ckpt_path="last"``."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from tierckpt import InvalidName
from tierckpt.lightning import TierCheckpointIO
from tierckpt.storage_reader import TieredStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.support import lightning_job
from tests.support.cli import ls_ids, ls_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NS = "lightning-run"
_ROOT = Path(__file__).resolve().parents[2]


def _fit(daemon: Any, ckpts: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "tests.support.lightning_job", "--daemon", daemon.address]
    command += ["--namespace", NS, "--dir", str(ckpts), "--out", str(out), *args]
    return subprocess.run(
        command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )


def _differences(actual: Any, expected: Any, path: str = "") -> list[str]:
    """Every place where `actual` is not bit-exact `expected` (dicts, sequences, tensors)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{path}: {type(actual).__name__}, not a tensor"]
        same = actual.dtype == expected.dtype and actual.shape == expected.shape
        return [] if same and torch.equal(actual, expected) else [f"{path}: tensor differs"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            keys = actual.keys() if isinstance(actual, dict) else type(actual).__name__
            return [f"{path}: keys {keys} != {expected.keys()}"]
        return [d for k in expected for d in _differences(actual[k], expected[k], f"{path}.{k}")]
    if isinstance(expected, list | tuple):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return [f"{path}: {actual!r} != {expected!r}"]
        return [
            d
            for i, (a, e) in enumerate(zip(actual, expected, strict=True))
            for d in _differences(a, e, f"{path}[{i}]")
        ]
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


def _assert_exact(actual: Any, expected: Any, what: str) -> None:
    bad = _differences(actual, expected)
    assert not bad, f"{what}: not bit-exact:\n  " + "\n  ".join(bad[:20])


def _saved(out: Path, step: int) -> dict[str, Any]:
    loaded = torch.load(out / f"saved-step-{step}.pt", weights_only=False)
    assert isinstance(loaded, dict)
    return loaded


def test_fit_killed_then_resumed_from_last_is_bit_exact_and_keeps_top_k(
    daemon: Any, tmp_path: Path
) -> None:
    ckpts, out = tmp_path / "checkpoints", tmp_path / "out"

    # A fit that dies by SIGKILL after step 7: its last checkpoint is step 6.
    killed = _fit(daemon, ckpts, out, "--max-steps", "20", "--kill-at", "7")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # Retention ran through the tiers: step 2 was removed when step 6 made the top 2.
    assert sorted(ls_ids(daemon.address, NS)) == [
        "epoch=0-step=4.ckpt",
        "epoch=0-step=6.ckpt",
        "last.ckpt",
    ]
    # The folder holds pointer files naming the same checkpoints.
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(ls_ids(daemon.address, NS))
    assert (ckpts / "last.ckpt").read_text() == f"tierckpt://{NS}/last.ckpt\n"

    # The whole dict Lightning saved comes back bit-exact (loops, callbacks, optimizer).
    plugin = TierCheckpointIO(NS, daemon=daemon.address)
    expected = _saved(out, 6)
    _assert_exact(plugin.load_checkpoint(ckpts / "last.ckpt"), expected, "last.ckpt")
    _assert_exact(
        plugin.load_checkpoint(f"tierckpt://{NS}/epoch=0-step=4.ckpt"), _saved(out, 4), "step 4"
    )

    # A new process resumes with ckpt_path="last" and trains on to step 12.
    resumed = _fit(daemon, ckpts, out, "--max-steps", "12", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "finished at step 12" in resumed.stdout, resumed.stdout[-2000:]
    restored = torch.load(out / "restored.pt", weights_only=False)
    assert restored["global_step"] == 6 and restored["epoch"] == expected["epoch"]
    _assert_exact(restored["state_dict"], expected["state_dict"], "model after resume")
    _assert_exact(
        restored["optimizer_states"], expected["optimizer_states"], "optimizer after resume"
    )
    _assert_exact(restored["lr_schedulers"], expected["lr_schedulers"], "LR scheduler")
    # The resumed ModelCheckpoint knew the top 2 it restored: steps 4 and 6 were retired
    # as 8, 10 and 12 were saved, and last.ckpt was replaced in place.
    assert sorted(ls_ids(daemon.address, NS)) == [
        "epoch=0-step=10.ckpt",
        "epoch=0-step=12.ckpt",
        "last.ckpt",
    ]
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(ls_ids(daemon.address, NS))
    last = plugin.load_checkpoint(f"tierckpt://{NS}/latest")
    assert last["global_step"] == 12
    _assert_exact(last, _saved(out, 12), "newest checkpoint")
    plugin.teardown()

    # The pointer folder is lost (another node): the URL resumes, here in this process.
    moved = lightning_job.fit(
        daemon.address,
        NS,
        tmp_path / "moved",
        tmp_path / "moved-out",
        14,
        ckpt_path=f"tierckpt://{NS}/last.ckpt",
    )
    assert moved.global_step == 14
    restored = torch.load(tmp_path / "moved-out" / "restored.pt", weights_only=False)
    assert restored["global_step"] == 12
    _assert_exact(restored["state_dict"], last["state_dict"], "model resumed from the URL")
    _assert_exact(restored["optimizer_states"], last["optimizer_states"], "optimizer from the URL")


def test_remove_checkpoint_retires_it_from_the_tiers_and_a_link_only_unlinks(
    daemon: Any, tmp_path: Path
) -> None:
    plugin = TierCheckpointIO(NS, daemon=daemon.address)
    state = {"state_dict": {"w": torch.arange(6.0)}, "global_step": 3, "note": "x"}
    path = tmp_path / "epoch=0-step=3.ckpt"
    plugin.save_checkpoint(state, path)
    # The tensor is a DCP tensor of the checkpoint, not pickled bytes.
    reader = TieredStorageReader(NS, daemon=daemon.address)
    reader.reset(path.name)
    items = reader.read_metadata().state_dict_metadata
    reader.client.close()
    tensors = [v for v in items.values() if isinstance(v, TensorStorageMetadata)]
    assert [(t.size, t.properties.dtype) for t in tensors] == [(torch.Size([6]), torch.float32)]
    link = tmp_path / "last.ckpt"
    link.symlink_to(path.name)  # what ModelCheckpoint(save_last="link") makes
    assert plugin.url(link) == plugin.url(path) == f"tierckpt://{NS}/{path.name}"
    with pytest.raises(InvalidName, match="file name becomes the tierckpt checkpoint id"):
        plugin.save_checkpoint(state, tmp_path / "step 3.ckpt")
    _assert_exact(plugin.load_checkpoint(link), state, "through the link")
    plugin.remove_checkpoint(link)
    assert not link.exists() and path.exists()
    assert ls_ids(daemon.address, NS) == ["epoch=0-step=3.ckpt"]
    plugin.remove_checkpoint(path)
    assert not path.exists() and ls_ids(daemon.address, NS) == []

    # The non-tensor part is unpickled as Lightning asks: weights-only by default.
    odd = {"state_dict": {"w": torch.ones(2)}, "extra": Fraction(1, 3)}
    plugin.save_checkpoint(odd, tmp_path / "odd.ckpt")
    with pytest.raises(pickle.UnpicklingError, match="Fraction"):
        plugin.load_checkpoint(tmp_path / "odd.ckpt")
    _assert_exact(plugin.load_checkpoint(tmp_path / "odd.ckpt", weights_only=False), odd, "odd")
    plugin.teardown()


def test_saving_a_path_again_replaces_it_with_no_window(
    daemon_factory: Any, tmp_path: Path
) -> None:
    # `last.ckpt` saved again is replaced atomically: the new save commits as a new
    # generation; one that fails (here: over the memory budget) leaves the previous one.
    daemon = daemon_factory({"memory": {"budget": "8MiB"}})
    plugin = TierCheckpointIO(NS, daemon=daemon.address)
    path = tmp_path / "last.ckpt"

    def state(step: int, n: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(step)
        return {"state_dict": {"w": torch.randn(n, generator=gen)}, "global_step": step}

    def sequence() -> int:
        (row,) = ls_json(daemon.address, NS)
        assert row["id"] == "last.ckpt"
        return int(row["sequence"])

    plugin.save_checkpoint(state(1, 1 << 16), path)
    first = sequence()
    plugin.save_checkpoint(state(2, 1 << 16), path)
    assert sequence() > first
    _assert_exact(plugin.load_checkpoint(path), state(2, 1 << 16), "last.ckpt saved again")
    with pytest.raises(BaseException, match="budget"):  # DCP's CheckpointException
        plugin.save_checkpoint(state(3, 4 << 20), path)  # 16 MiB: over the budget
    _assert_exact(plugin.load_checkpoint(path), state(2, 1 << 16), "after a failed save")
    assert path.read_text() == f"tierckpt://{NS}/last.ckpt\n"
    plugin.teardown()
