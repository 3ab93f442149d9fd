"""torch_checkpointing through tierckpt vs its own filesystem backend into tmpfs.

Why: `tierckpt.integrations.torch_checkpointing.StorageConfig` claims its save and load
make no copy more than torch_checkpointing's `LocalFileSystemStorageConfig` (counted in
docs/torch-checkpointing.md); a user needs the time that costs next to the local backend
on the same medium (tmpfs), in the same run (the machine is shared: read the ratios, not
the seconds).

One rank, no process group, a state of fp32 tensors of `--mib` in all, torch_checkpointing's
real `CheckpointManager` with the synchronous saver (its blocking save is the whole write)
and its default mmap load; the same state and manager configuration for both backends:

- tierckpt: one tierckptd with its memory tier on tmpfs, `StorageConfig(namespace=...)`;
- local: `LocalFileSystemStorageConfig(use_direct_io=False)` into a directory on tmpfs
  (``/dev/shm``: O_DIRECT is refused there anyway).

Per backend: `--repeat` saves and loads (each save under a new id, the previous one
removed untimed), the backends alternating round by round (which goes first alternates
too), so a burst of load from elsewhere on a shared machine lands on both; the fastest
after the first is "steady". Every load is checked
bit-exact, untimed. Printed and written (`--out`): seconds per backend and the ratios
tierckpt / local.

    python bench/bench_torch_checkpointing.py [--quick] [--mib 1024] [--repeat 3] [--out F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import MiB, machine_facts, make_daemon, tmpfs_root  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "torch_checkpointing.json"
NS = "bench-tc"
TENSORS = 8


def _state(mib: float) -> dict[str, torch.Tensor]:
    per = max(1, int(mib * MiB) // 4 // TENSORS)
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(per, generator=g) for i in range(TENSORS)}


def _manager(storage: Any) -> Any:
    from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig

    return CheckpointManager(
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage)
    )


def _round(
    manager: Any,
    checkpoint_id: str,
    previous: str | None,
    state: dict[str, torch.Tensor],
    remove: Any,
) -> tuple[float, float]:
    """Save then load one id (seconds of each, the load checked bit-exact untimed), then
    remove the previous id untimed."""
    started = time.perf_counter()
    manager.save(checkpoint_id, {"model": state})
    save_s = time.perf_counter() - started
    into = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
    started = time.perf_counter()
    loaded = manager.load(checkpoint_id, into=into)
    load_s = time.perf_counter() - started
    for k, v in state.items():
        if not torch.equal(loaded["model"][k], v):
            raise AssertionError(f"{checkpoint_id}: {k} differs after the load")
    if previous is not None:
        remove(previous)
    return save_s, load_s


def _steady(seconds: list[float]) -> float:
    return min(seconds[1:]) if len(seconds) > 1 else seconds[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=1024.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 repeats (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    mib, repeat = (16.0, 2) if args.quick else (args.mib, args.repeat)

    from tierckpt.daemon_client import DaemonClient
    from tierckpt.integrations.torch_checkpointing import StorageConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    state = _state(mib)
    ids = [f"step-{i:06d}" for i in range(1, repeat + 1)]
    results: dict[str, Any] = {"mib": mib, "repeat": repeat, "machine": machine_facts()}
    results["tierckpt"] = {"save_s": [], "load_s": []}
    results["local"] = {"save_s": [], "load_s": []}

    d = make_daemon(budget=f"{max(1, int(mib * 4 // 1024) + 1)}GiB", keep_last=None)
    d.start()
    client = DaemonClient(d.address)
    local_root = Path(tempfile.mkdtemp(prefix="tc-local-", dir=tmpfs_root()))
    tier = _manager(StorageConfig(namespace=NS, daemon=d.address))
    local = _manager(LocalFileSystemStorageConfig(use_direct_io=False))

    def delete(checkpoint_id: str) -> None:
        client.delete_checkpoint(NS, checkpoint_id)

    def rmtree(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    try:
        for i, checkpoint_id in enumerate(ids):
            previous = ids[i - 1] if i else None
            local_previous = str(local_root / previous) if previous else None
            rounds: list[tuple[str, Any, str, str | None, Any]] = [
                ("tierckpt", tier, checkpoint_id, previous, delete),
                ("local", local, str(local_root / checkpoint_id), local_previous, rmtree),
            ]
            for name, manager, target, before, remove in rounds[:: 1 if i % 2 == 0 else -1]:
                save_s, load_s = _round(manager, target, before, state, remove)
                results[name]["save_s"].append(save_s)
                results[name]["load_s"].append(load_s)
    finally:
        tier.close()
        local.close()
        client.close()
        d.stop()
        shutil.rmtree(local_root, ignore_errors=True)

    for what in ("save_s", "load_s"):
        ours, theirs = _steady(results["tierckpt"][what]), _steady(results["local"][what])
        results[f"{what[:4]}_ratio"] = ours / theirs if theirs else None
        print(
            f"{what[:4]}: tierckpt {ours:.3f}s, local tmpfs {theirs:.3f}s, "
            f"ratio {results[f'{what[:4]}_ratio']:.2f}x ({mib:g} MiB, steady of {repeat})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
