"""Lightning 2.6's FSDP2 strategy through tierckpt: a real 2-rank `Trainer` on CPU
(gloo) with `TierModelParallelStrategy`, killed with SIGKILL mid-run and resumed with ``ckpt_path="last"``: every rank gets its own
model and optimizer shards back bit-exact, and ``ModelCheckpoint(save_top_k=2)`` retention
holds in the tiers. Lightning's own `ModelParallelStrategy` writes these shards into a local
folder and never calls the `CheckpointIO`, which is why the strategy exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_lightning import _assert_exact
from tests.support.cli import ls_ids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_ROOT = Path(__file__).resolve().parents[2]


def _fit(
    daemon: Any, ns: str, ckpts: Path, out: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "tests.support.lightning_sharded_job"]
    command += ["--daemon", daemon.address, "--namespace", ns]
    command += ["--dir", str(ckpts), "--out", str(out), *args]
    return subprocess.run(
        command,
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        start_new_session=True,  # the kill takes the job's whole process group
    )


def test_an_fsdp2_fit_killed_then_resumed_from_last_is_bit_exact_per_rank(
    daemon: Any, tmp_path: Path
) -> None:
    ns = "lightning-fsdp2"
    ckpts, out = tmp_path / "checkpoints", tmp_path / "out"

    killed = _fit(daemon, ns, ckpts, out, "--max-steps", "10", "--kill-at", "7")
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert (out / "rank-1-saved-step-6.pt").exists(), killed.stderr[-3000:]
    # The folder holds pointer files only; the shards of both ranks are in the tiers.
    names = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("."))
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"], names
    for name in names:
        assert (ckpts / name).is_file()
        assert (ckpts / name).read_text().strip() == f"tierckpt://{ns}/{name}"
    assert sorted(ls_ids(daemon.address, ns)) == names  # step 2 was removed from the tiers

    resumed = _fit(daemon, ns, ckpts, out, "--max-steps", "10", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    for rank in (0, 1):
        restored = torch.load(out / f"rank-{rank}-restored.pt", weights_only=False)
        saved = torch.load(out / f"rank-{rank}-saved-step-6.pt", weights_only=False)
        assert restored["global_step"] == 6
        _assert_exact(restored["model"], saved["model"], f"rank {rank} model shards")
        _assert_exact(restored["optimizer"], saved["optimizer"], f"rank {rank} optimizer")
    assert sorted(ls_ids(daemon.address, ns)) == [
        "epoch=0-step=10.ckpt",
        "epoch=0-step=8.ckpt",
        "last.ckpt",
    ]
