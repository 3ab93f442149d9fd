"""Listener registries: how a part tells parts built after it, without an attribute
written into it after construction.

A registry is built first (main.py's `build`) and handed to the part where the event
happens, which calls it; a part built later subscribes with `add` while the daemon is
being wired, before any thread runs. `Listeners` tells every subscriber; `Answer` asks
the one that answers (a question from a lower part to a higher one, with a default
while nobody answers, e.g. a node without peers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

__all__ = ["Answer", "Listeners"]

P = ParamSpec("P")
R = TypeVar("R")


class Listeners(Generic[P]):
    """Callables told of one kind of event, in the order they subscribed."""

    def __init__(self) -> None:
        self._listeners: list[Callable[P, object]] = []

    def add(self, listener: Callable[P, object]) -> None:
        self._listeners.append(listener)

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for listener in tuple(self._listeners):
            listener(*args, **kwargs)


class Answer(Generic[P, R]):
    """One question and the part that answers it; `default` until one does."""

    def __init__(self, default: Callable[P, R]) -> None:
        self._answer = default
        self._answered = False

    def answer_with(self, answer: Callable[P, R]) -> None:
        """The part that answers: the one built last (a daemon builds one; a test may
        build a second peer tier over the same catalog, which then answers)."""
        self._answer, self._answered = answer, True

    @property
    def answered(self) -> bool:
        return self._answered

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._answer(*args, **kwargs)
