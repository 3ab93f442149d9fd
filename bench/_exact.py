"""Bit-exact checks the chaos and soak ranks share: a zeroed target to load into, and a
comparison of every saved tensor as int32 words (so even a NaN payload counts)."""

from __future__ import annotations

from typing import Any

import torch


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """Zeroed tensors, and a non-tensor placeholder DCP replaces on load."""
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"index": -1}
        for k, v in state.items()
    }


def check_exact(loaded: dict[str, Any], expected: dict[str, Any], what: str) -> int:
    """Raise AssertionError naming the first leaf that differs; returns the bytes checked."""
    checked = 0
    for key, want in expected.items():
        got = loaded[key]
        if isinstance(want, torch.Tensor):
            if got.shape != want.shape or not torch.equal(
                got.view(torch.int32), want.view(torch.int32)
            ):
                raise AssertionError(f"{what}: tensor {key} differs from what was saved")
            checked += want.numel() * want.element_size()
        elif got != want:
            raise AssertionError(f"{what}: {key} is {got!r}, saved {want!r}")
    return checked
