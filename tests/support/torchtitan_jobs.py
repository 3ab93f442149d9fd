"""Rank functions that drive torchtitan 0.3.0's real `CheckpointManager` on CPU.

torchtitan's trainer needs CUDA, so each rank builds what the trainer would hand the
manager: a tiny model sharded with FSDP2 (`fully_shard` on a gloo CPU mesh), torchtitan's
`OptimizersContainer` (AdamW) and `LRSchedulersContainer` (warmup + linear decay), its
`ParallelAwareDataloader` over a deterministic per-rank stream, and a train state under
``train_state`` as the trainer registers itself. The checkpoint folder is a
``tierckpt://`` URL, which torchtitan sends through fsspec; each rank talks to its own
node's daemon (``TIERCKPT_DAEMON`` set per rank). Only torch, torchtitan and fsspec run
here: the training code imports no tierckpt.

What a rank saw is recorded with `save_expected` (DTensors gathered), plus the batch it
would draw next, so a resume in new processes is checked bit-exact against what was saved.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset

from tests.support.dist_job import RankContext
from tests.support.state_dicts import (
    assert_all_differ,
    assert_state_equal,
    load_expected,
    snapshot,
)

__all__ = ["resave_existing_step", "resume", "train_and_save"]

BATCH = 4
WIDTH = 24  # a shard per rank of every Linear; 24 rows split evenly, 5 do not


class _Stream(IterableDataset[torch.Tensor], Stateful):
    """An endless, deterministic stream of samples for one data-parallel rank.

    Stateful like torchtitan's own datasets: the loader saves the position (without it,
    torchdata fast-forwards naively and reports twice the samples after a resume).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sample = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            g = torch.Generator().manual_seed(1_000_003 * (self.rank + 1) + self.sample)
            self.sample += 1
            yield torch.randn(WIDTH, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"sample": self.sample}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sample = int(state_dict["sample"])


class _TrainState(Stateful):
    """What torchtitan's trainer saves about itself under ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict["ntokens_seen"])


class _Trainer:
    """The parts torchtitan's trainer builds and hands to its `CheckpointManager`."""

    def __init__(self, ctx: RankContext, folder: str, seed: int, **checkpoint: Any) -> None:
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        torch.manual_seed(seed)
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 5))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        adamw = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}
        self.optimizers: Any = OptimizersContainer(
            OptimizersContainer.Config(
                param_groups=[
                    ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=adamw)
                ],
                implementation="for-loop",
            ),
            model_parts=[model],
        )
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=5).build(
            optimizers=self.optimizers, training_steps=100
        )
        self.dataloader = ParallelAwareDataloader(
            _Stream(ctx.rank), dp_rank=ctx.rank, dp_world_size=ctx.world_size, batch_size=BATCH
        )
        self._batches: Iterator[torch.Tensor] | None = None
        self.train_state = _TrainState()
        config = CheckpointManager.Config(enable=True, folder=folder, interval=10, **checkpoint)
        self.checkpointer = CheckpointManager(
            config,
            dataloader=self.dataloader,
            model_parts=[model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
        )

    def next_batch(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = iter(self.dataloader)
        return next(self._batches)

    def train(self, until: int) -> None:
        """Train and offer a save at every step, as torchtitan's loop does."""
        while self.train_state.step < until:
            batch = self.next_batch()
            self.optimizers.zero_grad()
            self.model(batch).pow(2).mean().backward()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.train_state.step += 1
            self.train_state.ntokens_seen += batch.numel()
            self.checkpointer.save(self.train_state.step)
            self.checkpointer.maybe_wait_for_saving()  # no-op unless async

    def view(self) -> dict[str, Any]:
        """Everything a resume must restore, as the containers report it."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizers.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "lr": self.lr_schedulers.get_metrics(),
            "dataloader": self.dataloader.state_dict(),
            "train_state": self.train_state.state_dict(),
        }

    def record(self, directory: str, rank: int) -> None:
        """Snapshot the state just saved, and the batch the loop would draw next, where
        `load_expected` finds them."""
        snap = snapshot(self.view())  # collective: DTensors gathered
        snap["next_batch"] = self.next_batch()
        os.makedirs(directory, exist_ok=True)
        torch.save(snap, os.path.join(directory, f"expected.rank{rank}.pt"))


def _point_at_own_daemon(ctx: RankContext, addresses: list[str]) -> None:
    os.environ["TIERCKPT_DAEMON"] = addresses[ctx.rank]


def train_and_save(
    ctx: RankContext,
    addresses: list[str],
    folder: str,
    until: int,
    record_dir: str,
    seed: int,
    async_mode: str = "disabled",
) -> dict[str, Any]:
    """Train to `until` saving every 10 steps (keep_latest_k=2), record the last save,
    and return torchtitan's own discovery of the latest step."""
    _point_at_own_daemon(ctx, addresses)
    t = _Trainer(ctx, folder, seed, keep_latest_k=2, async_mode=async_mode)
    assert t.checkpointer.load() is False  # a fresh start, as torchtitan sees the folder
    t.train(until)
    t.record(record_dir, ctx.rank)
    t.checkpointer.close()  # joins the purge thread: retention has run
    dist.barrier()
    return {"found": t.checkpointer._find_load_step(), "async": t.checkpointer.async_mode.value}


def resume(
    ctx: RankContext, addresses: list[str], folder: str, record_dir: str, seed: int
) -> dict[str, Any]:
    """New processes: build everything from another seed, `load()` the latest step, and
    compare every restored part with what the saving run recorded."""
    _point_at_own_daemon(ctx, addresses)
    t = _Trainer(ctx, folder, seed, keep_latest_k=2)
    expected = load_expected(record_dir, ctx.rank)
    next_batch = expected.pop("next_batch")
    assert_all_differ(
        {"model": t.model.state_dict()}, expected, what=f"rank {ctx.rank} before load"
    )
    assert t.checkpointer.load() is True
    leaves = assert_state_equal(actual=t.view(), expected=expected, what=f"rank {ctx.rank} resume")
    assert torch.equal(t.next_batch(), next_batch), "the data loader did not resume in place"
    t.checkpointer.close()
    return {"step": t.train_state.step, "leaves": leaves}


def resave_existing_step(
    ctx: RankContext,
    addresses: list[str],
    folder: str,
    load_step: int,
    until: int,
    record_dir: str,
) -> dict[str, Any]:
    """A job restarted from an older step trains on and saves steps that exist, as it
    would overwrite them in a local folder. Its weights are nudged after the load (a
    restart with a changed setting), so the re-saved steps hold other bytes than the
    first run's; the last one is recorded."""
    _point_at_own_daemon(ctx, addresses)
    t = _Trainer(ctx, folder, 5, keep_latest_k=2, load_step=load_step)
    assert t.checkpointer.load(load_step) is True
    loaded = t.train_state.step
    with torch.no_grad():
        for param in t.model.parameters():
            param.mul_(1.01)
    t.train(until)
    t.record(record_dir, ctx.rank)
    t.checkpointer.close()
    dist.barrier()
    return {"loaded": loaded, "found": t.checkpointer._find_load_step()}
