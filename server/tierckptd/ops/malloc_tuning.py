"""glibc malloc settings for a daemon whose work is moving multi-MiB buffers.

Every peer chunk and S3 part passes through fresh 1-4 MiB `bytes` objects that gRPC and
s3fs allocate. With glibc's defaults, the memory freed at the top of a thread's arena is
handed back to the kernel (trimmed) and faulted in again by the next message: receiving
1 GiB from a peer made about 3,600 mprotect and 90 madvise calls, and the page faults
behind them (strace). Raising the mmap threshold to its 32 MiB ceiling and the trim
threshold to 1 GiB keeps those pages in the process; peer restores measured 10-15%
faster (bench/bench_peer_tier.py). The environment (MALLOC_*_) still wins when set.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["tune_malloc"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30


def tune_malloc() -> bool:
    """Apply the thresholds on glibc; returns whether they were applied."""
    if platform.libc_ver()[0] != "glibc":
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        logger.info("malloc thresholds left to the environment (MALLOC_*_ is set)")
        return False
    try:
        libc = ctypes.CDLL(None)
        ok: bool = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1) and ok
    except (OSError, AttributeError) as e:
        logger.info("malloc thresholds unchanged: %s", e)
        return False
    return ok
