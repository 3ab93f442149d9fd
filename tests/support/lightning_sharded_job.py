"""A 2-rank Lightning FSDP2 fit through `TierModelParallelStrategy`, run by the tests.

``python -m tests.support.lightning_sharded_job --daemon ADDR
--namespace NS --dir CKPTS --out OUT --max-steps N [--kill-at K] [--resume]``: Lightning
launches the second rank itself (its subprocess launcher). Checkpoints every 2 steps (top 2
by step, plus ``last.ckpt``); at each save every rank `torch.save`s its local shards of the
model and optimizer to OUT/rank-R-saved-step-S.pt; with ``--kill-at`` global zero SIGKILLs
the whole process group after step K (run it in its own session); with ``--resume`` it fits
with ``ckpt_path="last"`` and each rank writes what it restored to OUT/rank-R-restored.pt.
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
from tierckpt.lightning_strategies import TierModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

EVERY = 2
TOP_K = 2


def local(obj: Any) -> Any:
    """`obj` with every DTensor replaced by a copy of this rank's shard."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(local(v) for v in obj)
    return obj


class ShardedModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None  # set by the strategy before this runs
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Record(Callback):
    def __init__(self, out: Path, kill_at: int | None) -> None:
        self.out = out
        self.kill_at = kill_at

    def _shards(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return {
            "global_step": trainer.global_step,
            "model": local(dict(pl_module.state_dict())),
            "optimizer": local([o.state_dict() for o in trainer.optimizers]),
        }

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        path = self.out / f"rank-{trainer.global_rank}-saved-step-{trainer.global_step}.pt"
        torch.save(self._shards(trainer, pl_module), path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self.out / f"rank-{trainer.global_rank}-restored.pt"
        torch.save(self._shards(trainer, pl_module), path)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        if trainer.global_step == self.kill_at:
            trainer.strategy.barrier()  # both ranks are past the step's save
            if trainer.global_rank == 0:
                os.killpg(0, signal.SIGKILL)


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
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(7)
    strategy = TierModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        plugins=[TierCheckpointIO(args.namespace, daemon=args.daemon)],
        callbacks=[
            ModelCheckpoint(
                dirpath=args.dir,
                monitor="step",
                mode="max",
                save_top_k=TOP_K,
                every_n_train_steps=EVERY,
                save_last=True,
            ),
            Record(args.out, args.kill_at),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    loader = DataLoader(data, batch_size=4, shuffle=False)
    trainer.fit(ShardedModule(), loader, ckpt_path="last" if args.resume else None)
    print(f"rank {trainer.global_rank} finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
