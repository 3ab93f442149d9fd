"""Trust states of a checkpoint: what a job or a health check said of it after it was saved.

Why: a checkpoint that committed whole may still hold a bad state (NaN, silent data
corruption found later, a load that failed). A job marks it ``bad`` so that no "newest"
route ever restores it again, or ``verified`` once the next steps ran clean, so that a
recovery can ask for the newest checkpoint known good and retention never evicts it.
One definition for client and daemon; the mark is cluster-wide (`tierckpt mark`).
"""

from __future__ import annotations

import enum
import unicodedata
from typing import TYPE_CHECKING

from tierckpt.errors import InvalidArgument

if TYPE_CHECKING:
    from tierckpt.records import CheckpointInfo

__all__ = ["MAX_REASON", "Trust", "check_reason", "mark", "parse_trust"]

MAX_REASON = 256  # characters of a mark's reason kept and shown


class Trust(enum.Enum):
    """A checkpoint's trust state; unmarked (committed, nothing said) is None."""

    VERIFIED = "verified"
    BAD = "bad"


def parse_trust(value: Trust | str) -> Trust:
    """A Trust from itself or its name ("verified", "bad", any case); InvalidArgument
    naming the valid states otherwise."""
    if isinstance(value, Trust):
        return value
    text = str(value).strip().lower()
    for trust in Trust:
        if trust.value == text:
            return trust
    raise InvalidArgument(
        f"invalid trust state {str(value)[:32]!r}: expected one of "
        f"{', '.join(t.value for t in Trust)}"
    )


def check_reason(reason: str) -> str:
    """A mark's reason as kept: printable, one line, at most MAX_REASON characters
    (InvalidArgument for a longer one or a control character: it is shown in `ls`)."""
    if len(reason) > MAX_REASON:
        raise InvalidArgument(
            f"the reason of a mark is {len(reason)} characters: at most {MAX_REASON}"
        )
    if any(unicodedata.category(c).startswith("C") for c in reason):
        raise InvalidArgument("the reason of a mark holds a control character")
    return reason


def mark(
    namespace: str,
    checkpoint_id: str,
    trust: Trust | str,
    *,
    reason: str = "",
    daemon: str | None = None,
) -> CheckpointInfo:
    """Mark a committed checkpoint verified or bad on every node of the cluster, through
    the local daemon (`tierckpt mark NAMESPACE ID verified|bad`); returns it as marked.

    A trainer marks a checkpoint ``Trust.VERIFIED`` once the steps after it ran clean
    (or a health check passed), ``Trust.BAD`` when its state held NaN, failed an SDC
    check or failed to load. The newest mark wins; a BAD checkpoint is never restored as
    the newest, ``TieredStorageReader(ns, newest="verified")`` (``tierckpt://NS/
    latest-verified``, ``tierckpt pull --verified``) restores the newest VERIFIED one, and
    retention never evicts that one.

    Raises:
        InvalidArgument: `trust` is no trust state, or `reason` is too long.
        CheckpointNotFound: no tier knows the checkpoint.
        NotAJobNode: the local node is not one of the checkpoint's job.
    """
    from tierckpt.daemon_client import DaemonClient  # lazy: this module is the daemon's too

    client = DaemonClient(daemon)
    try:
        return client.mark_checkpoint(namespace, checkpoint_id, trust, reason=reason)[0]
    finally:
        client.close()
