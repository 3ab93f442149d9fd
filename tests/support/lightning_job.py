"""A tiny Lightning fit through `TierCheckpointIO`, run as its own process by the tests.

``python -m tests.support.lightning_job --daemon ADDR --namespace NS --dir CKPTS --out OUT
--max-steps N [--kill-at K] [--resume]``: checkpoints every 2 steps (top 2 by step, plus
``last.ckpt``); every checkpoint dict Lightning hands the IO is also `torch.save`d to
OUT/saved-step-S.pt (what a resume must give back); with ``--kill-at`` the process
SIGKILLs itself after step K; with ``--resume`` it fits with ``ckpt_path="last"`` and
writes what it restored to OUT/restored.pt when training starts.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tierckpt.lightning import TierCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EVERY = 2
TOP_K = 2


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Record(Callback):
    """Keeps what each save holds, kills the process at `kill_at`, dumps a resume's state."""

    def __init__(self, out: Path, kill_at: int | None) -> None:
        self.out = out
        self.kill_at = kill_at

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        torch.save(checkpoint, self.out / f"saved-step-{trainer.global_step}.pt")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "state_dict": pl_module.state_dict(),
            "optimizer_states": [o.state_dict() for o in trainer.optimizers],
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        }
        torch.save(restored, self.out / "restored.pt")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(
    daemon: str,
    namespace: str,
    ckpts: Path,
    out: Path,
    max_steps: int,
    *,
    kill_at: int | None = None,
    ckpt_path: str | None = None,
) -> pl.Trainer:
    """Fit `TinyModule` to `max_steps` through the plugin; `ckpt_path` as `Trainer.fit`'s."""
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(7)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    checkpoints = ModelCheckpoint(
        dirpath=ckpts,
        monitor="step",
        mode="max",
        save_top_k=TOP_K,
        every_n_train_steps=EVERY,
        save_last=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        plugins=[TierCheckpointIO(namespace, daemon=daemon)],
        callbacks=[checkpoints, Record(out, kill_at)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(TinyModule(), DataLoader(data, batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--daemon", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--max-steps", required=True, type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    trainer = fit(
        args.daemon,
        args.namespace,
        args.dir,
        args.out,
        args.max_steps,
        kill_at=args.kill_at,
        ckpt_path="last" if args.resume else None,
    )
    print(f"finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
