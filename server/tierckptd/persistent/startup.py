"""The persistent tier's start-up work: after READY, in the background (audit 3 H7, M7, L2).

A daemon serves its memory tier whatever S3 does: an endpoint that accepts connections
and never answers, or a shared bucket with millions of objects, must not hold READY
(both did: 423 s and 32 s). So once the servers answer, one thread:

1. aborts the open multipart uploads a killed drain of this node left (`abort_stale`):
   the data files this node owns of the committed checkpoints it holds, before their
   drain resumes (an upload started after this step is never taken for a stale one);
2. resumes those drains;
3. adopts the durable checkpoints of every known root (`discovery.adopt_all`: from the
   index, namespaces at once, under `ADOPT_BUDGET`); what it does not reach in time is
   learnt when asked for (`Discovery`). Only a complete adoption counts as a listing.

Until then a listing answers from what the node knows (and `Discovery.refresh` lists the
namespace asked for on its own), and a drain checks `.metadata` before it uploads, so
nothing waits on this thread for correctness.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tierckpt.errors import CheckpointNotFound
from tierckpt.names import FORMAT_FILES, METADATA_FILE

from tierckptd.catalog import Catalog
from tierckptd.config_secrets import redact
from tierckptd.persistent.listing import ADOPT_BUDGET, Discovery, adopt_all
from tierckptd.persistent.roots import Roots
from tierckptd.persistent.store import PersistentTier

__all__ = ["ABORT_DEADLINE", "abort_stale", "owned_files", "start_in_background"]

logger = logging.getLogger(__name__)

ABORT_DEADLINE = 60.0  # listing and aborting the open uploads of one root

FileKey = tuple[str, str, str]


def owned_files(catalog: Catalog, stores: Roots) -> dict[PersistentTier, set[FileKey]]:
    """The data files this node owns of the committed checkpoints it knows, by the tier
    each drains to: only this node uploads them (or, once it is gone, a replica holder)."""
    found: dict[PersistentTier, set[FileKey]] = {}
    for namespace, checkpoint_id in catalog.committed_keys():
        try:
            view = catalog.get(namespace, checkpoint_id)
        except CheckpointNotFound:
            continue
        tier = stores.tier(view.persistent_url)
        if tier is None:
            continue
        for f in view.files:
            data = f.name != METADATA_FILE or view.checkpoint_format == FORMAT_FILES
            if f.owner_node == catalog.node_id and data:
                found.setdefault(tier, set()).add((namespace, checkpoint_id, f.name))
    return found


def abort_stale(catalog: Catalog, stores: Roots, deadline: float = ABORT_DEADLINE) -> int:
    """Abort the open multipart uploads of `owned_files` (a kill -9 mid-upload left them
    open for good; S3 bills their parts). Call it before their drains resume. A root
    that cannot be listed only warns: the bucket's AbortIncompleteMultipartUpload
    lifecycle rule (README) is the backstop."""
    aborted = 0
    for tier, files in owned_files(catalog, stores).items():
        try:
            with tier.within(deadline):
                aborted += tier.abort_uploads(files)
        except Exception as e:
            logger.warning(
                "open multipart uploads under %s not checked: %s: %.300s",
                redact(tier.url),
                type(e).__name__,
                e,
            )
    return aborted


def start_in_background(
    catalog: Catalog,
    stores: Roots,
    resume: Callable[[], object],
    discovery: Discovery | None,
    *,
    budget: float = ADOPT_BUDGET,
) -> threading.Thread:
    """Start the module doc's steps on a daemon thread (main.py, right after READY)."""

    def run() -> None:
        began = time.monotonic()
        aborted = abort_stale(catalog, stores)
        resume()  # a restart mid-drain picks up where it stopped
        started = time.monotonic()
        complete = True
        adopted = 0
        for tier in stores.known():
            try:
                adopted += adopt_all(tier, catalog, stores.url_of(tier), budget=budget)
            except Exception as e:
                complete = False
                logger.error(
                    "cannot list the persistent tier %s: %s: %.300s",
                    redact(tier.url),
                    type(e).__name__,
                    e,
                )
        if complete and discovery is not None and time.monotonic() - started < budget:
            discovery.mark_listed()
        logger.info(
            "persistent tier start-up work done in %.1fs: %d open upload(s) aborted, %d "
            "checkpoint(s) adopted%s",
            time.monotonic() - began,
            aborted,
            adopted,
            "" if complete else " (incomplete: learnt when asked for)",
        )

    thread = threading.Thread(target=run, name="tierckptd-persistent-start", daemon=True)
    thread.start()
    return thread
