"""A checkpoint's trust mark (verified, bad) kept beside it in the persistent tier.

Why: the cluster's marks journal lives in each node's memory directory, so a loss of the
whole cluster loses it, and a fresh cluster restoring from the bucket would take a
checkpoint a job marked bad for the newest. The mark is stored as one small JSON
bookkeeping object (``<url>/.tierckpt/<ns>/<id>/trust.json``, outside the checkpoint
directory stock DCP reads): the drain writes it before `.metadata` when the checkpoint
was marked before it drained, the node a user asked writes it when the checkpoint is
durable already, and an rm or persistent retention deletes it with the rest of the
bookkeeping (a re-save under the id starts unmarked). Adoption from the bucket reads it
back: the mark journal takes it like any other mark (the newest stamp wins).

Read back from a bucket, it is not trusted: every field is checked, and an object that is
not a valid marker is ignored with a warning (the checkpoint is then simply unmarked).
"""

from __future__ import annotations

import json
import logging
import math

from tierckpt.errors import InvalidArgument
from tierckpt.names import check_namespace
from tierckpt.trust import check_reason, parse_trust

from tierckptd.model import Key, TrustMark
from tierckptd.persistent.roots import Roots
from tierckptd.persistent.store import PersistentTier

__all__ = ["TRUST_OBJECT", "decode", "encode", "read_trust", "store_trust"]

logger = logging.getLogger(__name__)

TRUST_OBJECT = "trust.json"
MAX_TRUST_BYTES = 4096


def encode(mark: TrustMark) -> bytes:
    return json.dumps(
        {
            "trust": mark.trust.value,
            "reason": mark.reason,
            "stamp": mark.stamp,
            "origin": mark.origin,
        },
        separators=(",", ":"),
    ).encode()


def decode(data: bytes) -> TrustMark:
    """A stored trust marker, every field checked.

    Raises:
        ValueError: not a trust marker, or a field out of range.
    """
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        stamp, origin, reason = raw["stamp"], raw["origin"], raw.get("reason", "")
        if type(stamp) is not float or not math.isfinite(stamp) or stamp <= 0:
            raise ValueError("the stamp is not a time")
        if not isinstance(origin, str) or not isinstance(reason, str):
            raise ValueError("origin and reason are strings")
        return TrustMark(
            parse_trust(str(raw["trust"])), check_reason(reason), stamp, check_namespace(origin)
        )
    except (KeyError, TypeError, ValueError, InvalidArgument) as e:
        raise ValueError(f"not a valid trust marker: {type(e).__name__}: {str(e)[:160]}") from None


def store_trust(stores: Roots, key: Key, url: str, mark: TrustMark) -> bool:
    """Write `mark` beside a checkpoint durable in the tier at `url` ("": `[persistent]
    url`); False when this node has no such tier or the checkpoint is not durable there
    (its drain writes the mark then). Raises what the tier raises on an outage (the
    caller retries)."""
    tier = stores.tier(url)
    if tier is None or not tier.is_durable(*key):
        return False
    tier.put_bookkeeping(*key, TRUST_OBJECT, encode(mark))
    logger.info("%s/%s: trust mark %s stored in %s", *key, mark.trust.value, tier.url)
    return True


def read_trust(tier: PersistentTier, key: Key) -> TrustMark | None:
    """The trust marker stored beside a checkpoint, None when there is none or it is not
    valid (warned). Raises what the tier raises on an outage."""
    try:
        raw = tier.read_bookkeeping(*key, TRUST_OBJECT, max_bytes=MAX_TRUST_BYTES)
        return None if raw is None else decode(raw)
    except ValueError as e:
        logger.warning("%s/%s: the trust marker in %s is ignored: %s", *key, tier.url, e)
        return None
