"""A monotonic clock the tests advance by hand, for the parts that take `clock=` (and
`sleep=`): what they do after a delay is then checked without waiting for it."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """Reads `now`; `sleep` advances it instead of waiting."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
