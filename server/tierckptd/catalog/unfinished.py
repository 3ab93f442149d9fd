"""Unfinished saves whose coordinator may have committed them: never thrown away early.

A multi-node save commits on the coordinator's daemon, which then publishes the cluster
manifest to every node holding files of it. If that publish never arrives (the node was
down, restarted, or the call failed), this node still sees the save as unfinished: a
WRITING record, or after a restart a data dir without a manifest (an *orphan*). Its
files may be the only copies of a committed checkpoint, so neither is collected before
the peers have been asked:

- `Catalog.sweep` (the sweeper) asks `resolve_unfinished` (the peer tier, wired in
  main.py) about an idle WRITING save holding committed files: a coordinator's manifest
  found is published here (the files become committed and held); every peer answering
  without it means the save failed (aborted as before); a peer not answering keeps it
  up to `UNFINISHED_PATIENCE` x abandon_after.
- `salvage_orphans` (after the start-up pull of manifests, then on every sweep) asks the
  peers about orphans of checkpoints this node does not know, installs the orphan files
  a committed manifest says this node owns once they verify against that manifest's
  checksums, and collects the rest when the checkpoint is known, every peer answered
  without it (at once without peers), or the patience is spent.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Literal

from tierckpt.errors import TierckptError
from tierckpt.units import format_size

from tierckptd.catalog.peer_state import PeerState
from tierckptd.memory.tier import UnsafePath
from tierckptd.model import FileRecord, Key, State

__all__ = ["UNFINISHED_PATIENCE", "Resolution", "UnfinishedSaves"]

logger = logging.getLogger("tierckptd.catalog")

Resolution = Literal["published", "absent", "unknown"]
# An unfinished save with committed files whose fate some peer could not tell is kept
# this many abandon_after periods (its coordinator may be restarting) before collection.
UNFINISHED_PATIENCE = 4


class UnfinishedSaves(PeerState):
    """WRITING saves and orphans kept until the cluster says what became of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Peer tier (main.py): ask the peers whether a checkpoint was committed and adopt
        # the manifest if so. None (no peers): nothing to ask, a save either finished here
        # or it failed.
        self.resolve_unfinished: Callable[[str, str], Resolution] | None = None
        self._orphans: dict[Key, dict[str, int]] = {}
        self._orphans_since = 0.0

    # ---- sweep of idle WRITING saves ---------------------------------------------------
    def sweep(self) -> list[Key]:
        """Abort WRITING saves idle longer than abandon_after (a rank died mid-save),
        except one whose coordinator may have committed it (see the module docstring);
        then salvage or collect orphans, and apply memory retention where a reader's
        grace ran out. Returns the keys aborted."""
        now = self._clock()
        with self._lock:
            stale = [
                r
                for r in self._records.values()
                if r.state is State.WRITING and now - r.last_activity > self.abandon_after
            ]
            ask = [
                (r.key, now - r.last_activity)
                for r in stale
                if self.resolve_unfinished is not None
                and any(f.committed and f.held for f in r.files.values())
            ]
        keep: set[Key] = set()
        for key, idle in ask:
            answer = self._resolve(key)
            if answer == "published" or (
                answer == "unknown" and idle <= UNFINISHED_PATIENCE * self.abandon_after
            ):
                keep.add(key)
        aborted = []
        with self._lock:
            for rec in stale:
                current = self._records.get(rec.key)
                if current is rec and rec.state is State.WRITING and rec.key not in keep:
                    self._abort(rec, f"no activity for {now - rec.last_activity:.0f} s")
                    aborted.append(rec.key)
        self.salvage_orphans()
        self.expire_landed()
        return aborted

    def _resolve(self, key: Key) -> Resolution:
        assert self.resolve_unfinished is not None
        try:
            return self.resolve_unfinished(*key)
        except TierckptError as e:
            logger.warning("cannot ask the peers about %s/%s: %s", *key, e)
            return "unknown"

    # ---- orphans (restart) -------------------------------------------------------------
    def keep_orphans(self, orphans: dict[Key, dict[str, int]]) -> None:
        """Adoption's unfinished data dirs (call under the lock; their bytes are already
        counted as quarantined)."""
        self._orphans = dict(orphans)
        self._orphans_since = self._clock()

    def salvage_orphans(self, *, final: bool = False) -> int:
        """Install the orphan files a committed manifest says this node owns (verified
        first, outside the lock) and collect the orphans that are settled: known to the
        catalog, or unknown past the patience (`final`: now). Returns bytes installed."""
        absent = self._ask_about_orphans()
        with self._lock:
            if not self._orphans:
                return 0
            late = final or (
                self._clock() - self._orphans_since > UNFINISHED_PATIENCE * self.abandon_after
            )
            candidates: list[tuple[Key, FileRecord]] = []
            for key, files in self._orphans.items():
                rec = self._records.get(key)
                if rec is None or rec.state is not State.COMMITTED:
                    continue
                for name, size in files.items():
                    f = rec.files.get(name)
                    if f is not None and self._salvageable(f, size):
                        candidates.append((key, dataclasses.replace(f)))
        good = [(key, f) for key, f in candidates if self._verified(key, f)]
        installed = 0
        with self._lock:
            for key, f in good:
                installed += self._install_orphan(key, f)
            settled = [k for k in self._orphans if k in absent or self._settled(k, late)]
            for key in settled:
                self._collect_orphan(key, self._orphans.pop(key))
        return installed

    def _ask_about_orphans(self) -> set[Key]:
        """Ask the peers about orphans this node knows nothing of (a manifest found is
        adopted here); returns those every peer answered without."""
        with self._lock:
            unknown = [k for k in self._orphans if k not in self._records]
        if self.resolve_unfinished is None:
            return set()
        return {key for key in unknown if self._resolve(key) == "absent"}

    def _settled(self, key: Key, late: bool) -> bool:
        """Whether an orphan's fate is known: its checkpoint committed here, or nothing
        known of it past the patience (a save of that id writing again keeps it)."""
        rec = self._records.get(key)
        return rec.state is State.COMMITTED if rec is not None else late

    def _salvageable(self, f: FileRecord, size: int) -> bool:
        return (
            not f.held
            and f.owner_node == self.node_id
            and f.size == size
            and f.checksums is not None
        )

    def _verified(self, key: Key, f: FileRecord) -> bool:
        assert f.checksums is not None
        path = self.tier.file_path(*key, f.name)
        ok, reason = self.tier.verify_file(path, f.size, f.checksums)
        if ok:
            try:
                self.tier.seal_file(path, exclusive=False)
            except (OSError, UnsafePath) as e:
                ok, reason = False, str(e)
        if not ok:
            logger.warning(
                "%s/%s/%s left by an unfinished save does not match the committed "
                "manifest (%s): not installed",
                *key,
                f.name,
                reason,
            )
        return ok

    def _install_orphan(self, key: Key, f: FileRecord) -> int:
        """Hold a verified orphan file (call under the lock); bytes installed."""
        rec = self._records.get(key)
        mine = rec.files.get(f.name) if rec is not None else None
        if rec is None or rec.state is not State.COMMITTED or mine is None or mine.held:
            return 0
        if (mine.size, mine.checksums, mine.owner_node) != (f.size, f.checksums, f.owner_node):
            return 0
        held = dataclasses.replace(mine, held=True)
        self._write_manifest(dataclasses.replace(rec, files={**rec.files, f.name: held}))
        mine.held = True
        self._orphans[key].pop(f.name, None)
        self._budget.quarantined -= f.size
        self._track(rec)
        logger.info(
            "%s/%s/%s: kept the file an unfinished save left here, %s: its coordinator "
            "committed the checkpoint while this daemon was down",
            *key,
            f.name,
            format_size(f.size),
        )
        return f.size

    def _collect_orphan(self, key: Key, files: dict[str, int]) -> None:
        """Remove what is left of an orphan (call under the lock)."""
        rec = self._records.get(key)
        for name in files:
            f = rec.files.get(name) if rec is not None else None
            if f is not None and f.held:
                continue
            try:
                self.tier.remove_file(self.tier.file_path(*key, name))
            except (OSError, UnsafePath) as e:
                logger.warning("cannot collect %s/%s/%s: %s", *key, name, e)
        self._budget.quarantined -= sum(files.values())
        if rec is None:
            self.tier.remove_checkpoint_dir(*key)
        if files:
            logger.warning(
                "collected %d files (%s) of the unfinished save %s/%s: %s",
                len(files),
                format_size(sum(files.values())),
                *key,
                "its coordinator did not commit it"
                if rec is None
                else "not part of the committed checkpoint",
            )
