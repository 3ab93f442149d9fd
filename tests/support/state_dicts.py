"""Deterministic training state for checkpoint tests, and a bit-exact comparison.

The state is what a real FSDP2 job checkpoints: a small MLP sharded with `fully_shard`
on a CPU device mesh (dims chosen so that most shards are uneven and, at world 4, one
shard is empty), AdamW after real optimizer steps (so `exp_avg`, `exp_avg_sq`, `step`
exist), a `Stateful` data-loader position and an RNG-state tensor under rank-unique keys
(DCP deduplicates same-key values to one rank's copy), a plain Python object and a
replicated tensor that dedup places in a single rank's file.

Expected values are *snapshots* taken right after the save (DTensors gathered to full
tensors), written to a directory per rank, so a load in another job -- at another world
size, or in one process without a process group -- is compared with exactly what was
saved instead of with a recomputation.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "DataLoaderPosition",
    "TrainState",
    "assert_all_differ",
    "assert_state_equal",
    "build_state",
    "load_expected",
    "plain_tensor_state",
    "save_expected",
    "snapshot",
    "state_bytes",
]

# (in, out) of each Linear: 771 / 389 / 3 rows do not divide by 2 or 4; 3 rows at world 4
# leave rank 3 with an empty shard.
LAYERS = ((257, 771), (771, 389), (389, 3))
BATCH = 8


class DataLoaderPosition(Stateful):
    """Where one rank's data loader is; stored under the rank-unique key `dataloader.rank_{r}`."""

    def __init__(self, rank: int, epoch: int, index: int, seed: int) -> None:
        self.rank = rank
        self.epoch = epoch
        self.index = index
        self.shuffle_seed = seed
        self.history = [index - i for i in range(3)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "epoch": self.epoch,
            "index": self.index,
            "shuffle_seed": self.shuffle_seed,
            "history": list(self.history),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rank = state_dict["rank"]
        self.epoch = state_dict["epoch"]
        self.index = state_dict["index"]
        self.shuffle_seed = state_dict["shuffle_seed"]
        self.history = list(state_dict["history"])


@dataclasses.dataclass
class TrainState:
    model: nn.Module
    optim: torch.optim.Optimizer
    state_dict: dict[str, Any]


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(LAYERS):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(LAYERS) - 1:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def build_state(
    seed: int,
    rank: int,
    *,
    steps: int = 2,
    lr: float = 1e-3,
    fsdp: bool | None = None,
) -> TrainState:
    """Train a small MLP for `steps` AdamW steps and return it with its checkpoint state dict.

    Args:
        seed: decides every value; two seeds give different values in every leaf.
        rank: this rank; selects the rank-unique keys and the rank's input batch.
        steps: optimizer steps taken (the optimizer `step` tensor equals it).
        lr: AdamW learning rate (lands in `optim.param_groups`).
        fsdp: shard with FSDP2 over all ranks of the default group; default: when a
            process group is initialized.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if fsdp is None:
        fsdp = dist.is_initialized()
    torch.manual_seed(seed)  # same initial weights on every rank
    model = _mlp()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed * 131 + rank)
    for _ in range(steps):
        x = torch.randn(BATCH, LAYERS[0][0], generator=gen)
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    torch.manual_seed(seed * 7919 + rank)
    rng = torch.get_rng_state()
    state: dict[str, Any] = {
        "model": model_sd,
        "optim": optim_sd,
        f"dataloader.rank_{rank}": DataLoaderPosition(
            rank, epoch=seed % 5, index=1000 + 37 * seed + rank, seed=seed
        ),
        f"rng.rank_{rank}": rng,
        "meta": {"run": f"run-{seed}", "seed": seed, "steps": steps, "tags": ["a", str(seed)]},
        "replicated": torch.arange(1000, dtype=torch.float64) * (seed + 0.5),
    }
    return TrainState(model, optim, state)


def apply_and_reread(train: TrainState) -> dict[str, Any]:
    """Push a loaded state dict into the model and optimizer, then read it back out."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    set_state_dict(
        train.model,
        train.optim,
        model_state_dict=train.state_dict["model"],
        optim_state_dict=train.state_dict["optim"],
    )
    model_sd, optim_sd = get_state_dict(train.model, train.optim)
    return {"model": model_sd, "optim": optim_sd}


def plain_tensor_state(seed: int, nbytes: int) -> dict[str, Any]:
    """A no-PG state dict of plain float32 tensors totalling about `nbytes`, plus a Python object."""
    gen = torch.Generator().manual_seed(seed)
    n_tensors = 4
    per = max(1, nbytes // 4 // n_tensors)
    state: dict[str, Any] = {f"t{i}": torch.randn(per + i, generator=gen) for i in range(n_tensors)}
    state["meta"] = {"seed": seed, "name": f"plain-{seed}"}
    return state


def state_bytes(state: dict[str, Any]) -> int:
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            total += state_bytes(value)
    return total


def _snap(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()  # collective: same order on every rank
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Stateful):
        return copy.deepcopy(value.state_dict())
    if isinstance(value, dict):
        return {k: _snap(v) for k, v in value.items()}
    return copy.deepcopy(value)


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Full, detached copies of every value (DTensors gathered; collective on all ranks)."""
    return _snap(state)


def save_expected(state: dict[str, Any], directory: str, rank: int) -> dict[str, Any]:
    snap = snapshot(state)
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save(snap, Path(directory, f"expected.rank{rank}.pt"))
    return snap


def load_expected(directory: str, rank: int) -> dict[str, Any]:
    return torch.load(Path(directory, f"expected.rank{rank}.pt"), weights_only=False)


def _leaves(actual: Any, expected: Any, path: str, out: list[tuple[str, Any, Any]]) -> None:
    if isinstance(expected, dict) and not isinstance(actual, Stateful):
        if not isinstance(actual, dict):
            out.append((path, actual, expected))
            return
        for key in expected:
            _leaves(
                actual.get(key, _MISSING), expected[key], f"{path}.{key}" if path else str(key), out
            )
        out.extend(
            (f"{path}.{key}" if path else str(key), actual[key], _MISSING)
            for key in actual
            if key not in expected
        )
        return
    out.append((path, actual, expected))


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _describe(value: Any) -> str:
    if isinstance(value, DTensor):
        return f"DTensor{tuple(value.shape)} {value.dtype} {value.placements}"
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) < 200 else text[:200] + "..."


def _compare(actual: Any, expected: Any) -> tuple[bool, str]:
    """(equal, detail); for DTensors both the full tensor and this rank's local shard."""
    if isinstance(expected, torch.Tensor):
        if isinstance(actual, DTensor):
            full = actual.full_tensor()  # collective
            local_expected = distribute_tensor(
                expected, actual.device_mesh, actual.placements, src_data_rank=None
            ).to_local()
            if full.dtype != expected.dtype or full.shape != expected.shape:
                return False, f"{_describe(actual)} vs {_describe(expected)}"
            if not torch.equal(full, expected):
                return False, "full tensor differs"
            if not torch.equal(actual.to_local(), local_expected):
                return False, "local shard differs"
            return True, ""
        if not isinstance(actual, torch.Tensor):
            return False, f"{_describe(actual)} vs {_describe(expected)}"
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return False, f"{_describe(actual)} vs {_describe(expected)}"
        return torch.equal(actual, expected), "values differ"
    if isinstance(actual, Stateful):
        actual = actual.state_dict()
    return actual == expected, f"{_describe(actual)} != {_describe(expected)}"


def assert_state_equal(*, actual: dict[str, Any], expected: dict[str, Any], what: str = "") -> int:
    """Assert every leaf of `expected` is bit-exact in `actual`; returns the number of leaves.

    Keyword-only: the two arguments are easy to swap, and the report names them.

    Only keys present in `actual` at top level are compared, so a loader that holds a
    subset (another world size: other ranks' `dataloader.rank_*`) passes the relevant
    part of the snapshot. Collective for DTensor leaves: call on every rank.
    """
    wanted = {k: v for k, v in expected.items() if k in actual}
    missing_top = [k for k in actual if k not in expected]
    leaves: list[tuple[str, Any, Any]] = []
    _leaves(actual, wanted, "", leaves)
    bad = [f"{k}: not in the saved state" for k in missing_top]
    for path, act, exp in leaves:  # compare all before failing: DTensor leaves are collective
        if act is _MISSING or exp is _MISSING:
            bad.append(f"{path}: {'missing after load' if act is _MISSING else 'unexpected key'}")
            continue
        ok, detail = _compare(act, exp)
        if not ok:
            bad.append(f"{path}: {detail}")
    assert not bad, f"{what}: {len(bad)} of {len(leaves)} leaves not bit-exact:\n  " + "\n  ".join(
        bad
    )
    assert leaves, f"{what}: nothing compared"
    return len(leaves)


def assert_all_differ(actual: dict[str, Any], expected: dict[str, Any], *, what: str = "") -> int:
    """Assert every leaf of `actual` differs from `expected` (so a later equality means a load)."""
    wanted = {k: v for k, v in expected.items() if k in actual}
    leaves: list[tuple[str, Any, Any]] = []
    _leaves(actual, wanted, "", leaves)
    same = []
    for path, act, exp in leaves:
        if act is _MISSING or exp is _MISSING:
            continue
        if isinstance(act, DTensor):
            equal = act.full_tensor().shape == exp.shape and torch.equal(act.full_tensor(), exp)
        elif isinstance(act, torch.Tensor):
            equal = act.shape == exp.shape and torch.equal(act, exp)
        else:
            equal = (act.state_dict() if isinstance(act, Stateful) else act) == exp
        if equal:
            same.append(path)
    assert not same, f"{what}: target already equals the saved state at {same}"
    assert leaves, f"{what}: nothing compared"
    return len(leaves)
