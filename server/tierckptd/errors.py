"""Daemon-side errors that never travel to a client as such.

`SourceUnavailable` is what a `FileSource` raises when its tier cannot be reached (a peer
that does not answer, an S3 outage, a 403): the restore falls through to the next source,
and if no source had a valid copy the client gets UNAVAILABLE naming it
(`tierckpt.errors.TierUnavailable`), never DATA_LOSS.
"""

from __future__ import annotations

__all__ = ["SourceUnavailable"]


class SourceUnavailable(ConnectionError):
    """A tier could not be asked (outage, refusal, timeout); the copy may well exist.

    `source` names the tier ("peer node-b", "persistent s3://bucket/prefix"), the message
    says why. Picklable with its arguments.
    """

    def __init__(self, source: str, cause: str) -> None:
        super().__init__(source, cause)
        self.source = source
        self.cause = cause

    def __str__(self) -> str:
        return f"{self.source} unavailable: {self.cause}"
