"""Checking errors that may arrive raw or wrapped in DCP's CheckpointException.

With a process group, DCP gathers every rank's exception and raises
`CheckpointException` -- a `BaseException` -- whose `failures` maps rank to
`(exception, traceback)`. Without one, errors may arrive raw. Tests therefore catch
`BaseException`, look through the wrapper, and assert on type and message.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["assert_error", "capture", "originals"]


def capture(fn: Callable[[], Any], *, within: float | None = None) -> BaseException:
    """Run `fn`, which must raise; return what it raised (any BaseException but a test exit)."""
    start = time.monotonic()
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        elapsed = time.monotonic() - start
        if within is not None:
            assert elapsed <= within, (
                f"the error took {elapsed:.1f}s to surface (limit {within}s): {exc}"
            )
        return exc
    raise AssertionError("expected an error, but the call succeeded")


def originals(exc: BaseException) -> list[BaseException]:
    """The underlying exceptions: each rank's if `exc` is a CheckpointException, else `exc`."""
    if isinstance(exc, CheckpointException):
        return [wrapped[0] for wrapped in exc.failures.values()]
    return [exc]


def assert_error(
    exc: BaseException, cls: type[BaseException], pattern: str, *, load: bool = False
) -> list[BaseException]:
    """Assert that `exc` is, or wraps, a `cls` whose message matches regex `pattern` (case-insensitive).

    With `load=True` an `AssertionError` from DCP's metadata step is accepted in place of
    `cls`: torch 2.13 catches any exception of `StorageReader.read_metadata` and re-raises
    `AssertionError("metadata is None; global metadata read failed: <message>")`
    (torch/distributed/checkpoint/state_dict_loader.py:233-265), keeping only the text.

    Returns the matching underlying exceptions.
    """

    def matches_type(err: BaseException) -> bool:
        if isinstance(err, cls):
            return True
        return load and isinstance(err, AssertionError) and "metadata read failed" in str(err)

    found = [e for e in originals(exc) if matches_type(e)]
    assert found, (
        f"expected {cls.__name__}, got {type(exc).__name__} "
        f"wrapping {[type(e).__name__ for e in originals(exc)]}: {exc}"
    )
    for err in found:
        assert re.search(pattern, str(err), re.IGNORECASE), (
            f"{type(err).__name__} message does not match {pattern!r}: {err}"
        )
    assert re.search(pattern, str(exc), re.IGNORECASE), f"surfaced message lacks {pattern!r}: {exc}"
    return found


def describe(exc: BaseException) -> dict[str, Any]:
    """A picklable summary for returning an error from a rank."""
    return {
        "outer": type(exc).__name__,
        "types": [[c.__name__ for c in type(e).__mro__] for e in originals(exc)],
        "messages": [str(e) for e in originals(exc)],
        "text": str(exc),
    }
