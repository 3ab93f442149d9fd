"""Test-only: a wall clock that a test can step inside a running daemon process.

A daemon started with this directory on PYTHONPATH and `TIERCKPT_TEST_CLOCK_FILE` set
(`tests/integration/test_clock_order.py`) gets a `time.time()` that adds the seconds that
file holds (re-read at most every 20 ms), as an NTP step or a resumed VM shifts a node's
wall clock; `time.monotonic()` is untouched, as the kernel's is. Without the variable this
module does nothing. It is never installed: only tests put it on the path.
"""

from __future__ import annotations

import os
import time

_PATH = os.environ.get("TIERCKPT_TEST_CLOCK_FILE", "")

if _PATH:
    _real_time = time.time
    _real_time_ns = time.time_ns
    _monotonic = time.monotonic
    _cache = [0.0, -1.0]  # offset, when read (monotonic)

    def _offset() -> float:
        now = _monotonic()
        if now - _cache[1] > 0.02:
            try:
                with open(_PATH, encoding="ascii") as f:
                    _cache[0] = float(f.read(64).strip() or 0.0)
            except (OSError, ValueError):
                _cache[0] = 0.0
            _cache[1] = now
        return _cache[0]

    def _time() -> float:
        return _real_time() + _offset()

    def _time_ns() -> int:
        return _real_time_ns() + int(_offset() * 1e9)

    time.time = _time
    time.time_ns = _time_ns
