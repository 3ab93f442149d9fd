"""Restart adoption: what a previous daemon (restart or kill -9) left in the memory dir.

`adopt(tier)` scans the manifests, verifies every held file against its manifest,
quarantines checkpoints that fail (their manifest is renamed ``*.json.corrupt``, their
files kept for inspection), and collects leftovers: interrupted transfers, manifest tmp
files, and anything the layout does not allow (links, bad names), removed without being
followed. A data dir without a manifest is an unfinished save *here*, but its coordinator
may have committed it while this daemon was down (the publish never arrived): its files
are kept as orphans until the peers' manifests are pulled (`Catalog.salvage_orphans`
verifies the ones a manifest names and collects the rest). It returns plain records; the
catalog installs them. Runs before the daemon serves, so it needs no lock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt.errors import InvalidName
from tierckpt.names import check_file_name, check_namespace, checkpoint_id_of_flat
from tierckpt.units import format_size

from tierckptd.memory.manifest import ManifestError, read_manifest
from tierckptd.memory.tier import MemoryTier
from tierckptd.memory.verify import hash_rate, verify_files
from tierckptd.model import CheckpointRecord, Key, State
from tierckptd.ops.faults import fault

__all__ = ["Adopted", "adopt"]

logger = logging.getLogger(__name__)


@dataclass
class Adopted:
    """Checkpoints whose files all verified (COMMITTED), the bytes of the files of
    quarantined ones (kept on disk, so they count against the budget), and the files of
    unfinished saves (orphans: name -> size per checkpoint, also on disk)."""

    records: dict[Key, CheckpointRecord]
    quarantined_bytes: int
    orphans: dict[Key, dict[str, int]] = field(default_factory=dict)

    @property
    def orphan_bytes(self) -> int:
        return sum(sum(files.values()) for files in self.orphans.values())


def adopt(tier: MemoryTier) -> Adopted:
    """Scan, verify, quarantine and collect (see the module docstring)."""
    adopted, quarantined = _adopt_manifests(tier)
    orphans: dict[Key, dict[str, int]] = {}
    return Adopted(adopted, _collect_data(tier, adopted, quarantined, orphans), orphans)


def _adopt_manifests(tier: MemoryTier) -> tuple[dict[Key, CheckpointRecord], set[Key]]:
    adopted: dict[Key, CheckpointRecord] = {}
    quarantined: set[Key] = set()
    started, hashed = time.monotonic(), 0
    for ns_entry in _layout_dirs(tier, tier.manifest_root, check_namespace):
        for entry in tier.entries(Path(ns_entry.path)):
            path = Path(entry.path)
            if not entry.is_file(follow_symlinks=False):
                tier.remove_entry(entry, "not a regular file")
                continue
            stem = entry.name.removesuffix(".json.corrupt").removesuffix(".json")
            if stem == entry.name:
                os.unlink(path)  # a manifest tmp file of a crashed write
                continue
            try:
                key = (ns_entry.name, checkpoint_id_of_flat(stem))
            except InvalidName:
                tier.remove_entry(entry, "not a valid name")
                continue
            if entry.name.endswith(".json.corrupt"):
                quarantined.add(key)
                continue
            problem = ""
            try:
                rec = read_manifest(path)
                if rec.key != key:
                    problem = f"manifest describes {rec.namespace}/{rec.checkpoint_id}"
            except ManifestError as e:
                problem = str(e)
            fault("adopt.checkpoint")
            if not problem:
                result = verify_files(tier, *key, rec.files.values(), seal=True, stop_at_first=True)
                hashed += result.verified_bytes
                problem = next((f"{n}: {why}" for n, why in result.problems.items()), "")
            if problem:
                logger.error(
                    "not serving %s/%s: %s; its manifest is renamed to %s.corrupt and its "
                    "files are kept for inspection (remove them by hand)",
                    *key,
                    problem,
                    path.name,
                )
                os.rename(path, path.with_name(path.name + ".corrupt"))
                quarantined.add(key)
                continue
            rec.state = State.COMMITTED
            adopted[key] = rec
    logger.info(
        "verified %d checkpoints (%s) at %s",
        len(adopted),
        format_size(hashed),
        hash_rate(hashed, started),
    )
    return adopted, quarantined


def _collect_data(
    tier: MemoryTier,
    adopted: dict[Key, CheckpointRecord],
    quarantined: set[Key],
    orphans: dict[Key, dict[str, int]],
) -> int:
    """Remove files an adopted manifest does not hold and record the files of data dirs
    without a manifest in `orphans` (empty dirs go); returns the bytes of quarantined
    checkpoints' files."""
    quarantined_bytes = 0
    for ns_entry in _layout_dirs(tier, tier.data_root, check_namespace):
        for ckpt_entry in _layout_dirs(tier, Path(ns_entry.path), checkpoint_id_of_flat):
            key = (ns_entry.name, checkpoint_id_of_flat(ckpt_entry.name))
            held = (
                {f.name for f in adopted[key].files.values() if f.held} if key in adopted else set()
            )
            sizes: dict[str, int] = {}
            for entry in tier.entries(Path(ckpt_entry.path)):
                if not entry.is_file(follow_symlinks=False):
                    tier.remove_entry(entry, "not a regular file")
                elif entry.name not in held and (key in adopted or _unfinished(entry.name)):
                    os.unlink(entry.path)  # an interrupted peer transfer or write
                else:
                    sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
            if key in adopted:
                continue
            if key in quarantined:
                quarantined_bytes += sum(sizes.values())
                continue
            if not sizes:
                tier.remove_checkpoint_dir(*key)
                continue
            logger.info(
                "unfinished save %s/%s: %d files, %s, kept until the peers' manifests say "
                "whether its coordinator committed it",
                *key,
                len(sizes),
                format_size(sum(sizes.values())),
            )
            orphans[key] = sizes
    return quarantined_bytes


def _unfinished(name: str) -> bool:
    """A copy still arriving (`.NAME.incoming`) or a name no DCP file has."""
    try:
        check_file_name(name)
    except InvalidName:
        return True
    return name.endswith(".incoming") and name.startswith(".")


def _layout_dirs(
    tier: MemoryTier, parent: Path, check: Callable[[object], str]
) -> Iterator[os.DirEntry[str]]:
    """Real subdirectories of `parent` named by `check`; anything else (a link, a file,
    a bad name) is removed without following it."""
    for entry in tier.entries(parent):
        if not entry.is_dir(follow_symlinks=False):
            tier.remove_entry(entry, "not a directory")
            continue
        try:
            check(entry.name)
        except InvalidName:
            tier.remove_entry(entry, "not a valid name")
            continue
        tier.fix_dir_mode(entry)
        yield entry
