"""Namespaces' own memory windows, as set on this node (`Catalog.set_memory_keep_last`).

A namespace may keep fewer of its checkpoints in memory than `[retention]
memory_keep_last` (the SageMaker API's `steps_retained`). The value set here is what the
namespace's next commit on this node records (`CheckpointRecord.memory_keep_last`); the
record's manifest carries it to every node, and retention reads it from the newest
record (`retention.namespace_window`), so a node that never saw the setting applies it
too. Held in memory only, like a namespace's persistent URL: the writer sets it again
when it starts, and a restarted adapter learns it back from the committed records.

It shares the catalog's lock (as `durability.DurabilityLedger` does): `get` is called
with it held; `set` takes it.
"""

from __future__ import annotations

import threading

from tierckpt.errors import InvalidArgument, MemoryBudgetExceeded

from tierckptd.model import MAX_NAMESPACE_KEEP_LAST

__all__ = ["MAX_NAMESPACE_WINDOWS", "NamespaceWindows"]

MAX_NAMESPACE_WINDOWS = 65_536  # namespaces with their own memory window on one node


class NamespaceWindows:
    """namespace -> the memory window its next commit here records (0: none)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._windows: dict[str, int] = {}

    def get(self, namespace: str) -> int:
        """The window the namespace's next commit records (under the lock)."""
        return self._windows.get(namespace, 0)

    def set(self, namespace: str, keep_last: int) -> None:
        """Set (0: clear) the namespace's window; the caller checked the namespace name.

        Raises:
            InvalidArgument: `keep_last` outside 0..MAX_NAMESPACE_KEEP_LAST.
            MemoryBudgetExceeded: too many namespaces have one on this node.
        """
        if type(keep_last) is not int or not 0 <= keep_last <= MAX_NAMESPACE_KEEP_LAST:
            raise InvalidArgument(
                f"memory window of namespace {namespace}: keep_last {str(keep_last)[:32]} is "
                f"not an integer in 0..{MAX_NAMESPACE_KEEP_LAST} (0: [retention] "
                "memory_keep_last alone)"
            )
        with self._lock:
            if not keep_last:
                self._windows.pop(namespace, None)
                return
            if namespace not in self._windows and len(self._windows) >= MAX_NAMESPACE_WINDOWS:
                raise MemoryBudgetExceeded(
                    f"cannot set the memory window of namespace {namespace}: "
                    f"{MAX_NAMESPACE_WINDOWS} namespaces have one on this node"
                )
            self._windows[namespace] = keep_last
