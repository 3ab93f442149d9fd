"""Unfinished saves whose coordinator may have committed them: asked of the cluster
before the catalog throws them away.

A multi-node save commits on the coordinator's daemon, which then publishes the cluster
manifest to every node holding files of it. If that publish never arrives (the node was
down, restarted, or the call failed), this node still sees the save as unfinished: a
WRITING record, or after a restart a data dir without a manifest (an *orphan*). Its
files may be the only copies of a committed checkpoint, so neither is collected before
the peers have been asked (`resolve`: `Cluster.resolve_unfinished`, which publishes a
coordinator's manifest found here):

- `sweep` (the sweeper): an idle WRITING save holding committed files is kept when its
  manifest was found ("published"; its files become committed and held) or a peer could
  not tell ("unknown"), up to `UNFINISHED_PATIENCE` x abandon_after; every peer answering
  without it means the save failed (aborted as before);
- `salvage_orphans` (after the start-up pull of manifests, then on every sweep): orphans
  of checkpoints this node does not know are asked about; the catalog installs the orphan
  files a committed manifest says this node owns once they verify, and collects those
  every peer answered without (at once without peers) or past the patience.

The catalog keeps the records and files (`Catalog.idle_saves`, `abort_idle`,
`salvage_orphans`); this module only asks and decides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tierckpt.errors import TierckptError

from tierckptd.catalog import UNFINISHED_PATIENCE, Catalog, Resolution
from tierckptd.model import Key

__all__ = ["UnfinishedSaves"]

logger = logging.getLogger(__name__)

Resolve = Callable[[str, str], Resolution]


class UnfinishedSaves:
    """WRITING saves and orphans kept until the cluster says what became of them."""

    def __init__(self, catalog: Catalog, resolve: Resolve) -> None:
        self.catalog = catalog
        self._resolve_with = resolve

    def sweep(self) -> list[Key]:
        """Abort WRITING saves idle longer than abandon_after (a rank died mid-save),
        except one whose coordinator may have committed it (see the module docstring);
        then salvage or collect orphans, and apply memory retention where a reader's
        grace ran out. Returns the keys aborted."""
        patience = UNFINISHED_PATIENCE * self.catalog.abandon_after
        stale = self.catalog.idle_saves()
        keep: set[Key] = set()
        for key, idle, holds_committed in stale:
            if not holds_committed:
                continue
            answer = self._resolve(key)
            if answer == "published" or (answer == "unknown" and idle <= patience):
                keep.add(key)
        aborted = self.catalog.abort_idle(key for key, _, _ in stale if key not in keep)
        self.salvage_orphans()
        self.catalog.expire_landed()
        return aborted

    def salvage_orphans(self, *, final: bool = False) -> int:
        """Ask the peers about orphans this node knows nothing of (a manifest found is
        adopted here), then let the catalog install or collect them (bytes installed)."""
        unknown = self.catalog.unknown_orphans()
        absent = {key for key in unknown if self._resolve(key) == "absent"}
        return self.catalog.salvage_orphans(absent, final=final)

    def _resolve(self, key: Key) -> Resolution:
        try:
            return self._resolve_with(*key)
        except TierckptError as e:
            logger.warning("cannot ask the peers about %s/%s: %s", *key, e)
            return "unknown"
