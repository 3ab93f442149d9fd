"""What a persistent backend's failures mean: one `Backend` entry per URL scheme.

fsspec backends turn most failures into builtins (s3fs maps about 90 S3 codes to
`FileNotFoundError`, `PermissionError`, ``OSError(EBUSY)``, ...), but not all of them:
botocore's and aiohttp's transport errors derive from no builtin, and an S3 error that
s3fs does not translate carries only its code. One entry says, for one backend, which of
those a retry may cure, which mean "no such object" and which "these credentials are
refused", plus its client settings, whether its root is a directory on this node, and
the loggers whose DEBUG records carry its credentials. The retry loop, the store, the
restore source and the listing ask the tier's entry (`PersistentTier.backend`) instead
of knowing a backend themselves; only the store's abort of open multipart uploads asks
the filesystem whether it has any.

Adding one (say ``gs://`` through gcsfs) is an entry in `BACKENDS` and a ``Backend``
subclass in ``tests/conformance/test_persistent_source.py``, which checks that every
entry has one. A URL of a scheme not in the table gets `GENERIC`: the builtins only.
"""

from __future__ import annotations

import enum
import errno
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import xxhash
from tierckpt.errors import TierckptError

from tierckptd.config_secrets import redact

__all__ = [
    "BACKENDS",
    "GENERIC",
    "QUIET_LOGGERS",
    "Backend",
    "Failure",
    "PersistentTierUnavailable",
    "backend_for",
    "scheme_of",
    "tier_label",
]

_CAUSE_LIMIT = 300  # characters of an error message quoted in a cause


class PersistentTierUnavailable(ConnectionError):
    """The persistent tier kept failing for longer than the retry policy allows.

    Nothing was lost: what was not confirmed is simply not there yet (no `.metadata`
    without its data). Keep the checkpoint pending and retry the same call later.
    A daemon-side error, not a `TierckptError`: it is never sent to clients as such
    (those see the checkpoint as not yet durable). Picklable with its message.
    """


class Failure(enum.Enum):
    """What a backend's exception means to the tier."""

    TRANSIENT = "transient"
    """The store may answer if asked again: a refused or reset connection, a timeout,
    a 5xx, throttling. Retried under the `RetryPolicy`."""
    MISSING = "missing"
    """The store answered: there is no such object (or bucket). Final."""
    UNAVAILABLE = "unavailable"
    """The store could not be asked and asking again now will not help: the retries
    ran out, or it answered with an error the table does not know. The tier is down
    for this caller; nothing is lost."""
    DENIED = "denied"
    """The store refuses these credentials or this caller (403, a bad or expired key,
    a bucket policy). Not retried: the operator must act."""


# OSErrors that describe the request, not the service: a retry cannot help, and they say
# nothing about the store's health (a caller's own mistake, raised as it is).
_REQUEST_ERRORS = (FileExistsError, IsADirectoryError, NotADirectoryError)


@dataclass(frozen=True)
class Backend:
    """One persistent backend: how to read its failures and how to talk to it.

    Args:
        schemes: the URL schemes it serves (``s3``, ``s3a``).
        transient_names: class names (anywhere in an exception's MRO) of its transport
            errors that derive from no builtin, so that none of its packages is
            imported here.
        code_of: the backend's own error code carried by an exception ("" if none).
        codes: what a code means; an exception with a code not listed is UNAVAILABLE.
        quiet_loggers: loggers whose DEBUG records carry its credentials (signed
            headers, session tokens): the daemon never lets them below INFO.
        client_options: `storage_options` with the backend's client defaults filled in
            (what the operator set wins).
        library_retries: a cap on the client library's own retries (None: its own);
            the `RetryPolicy` retries an operation as a whole.
        local: the root is a directory on this node: directories exist before a write,
            a walk raises on an unreadable directory instead of skipping it as empty,
            and clients see the store only by a digest of its URL (a path on this node
            is not their business).
    """

    schemes: tuple[str, ...]
    transient_names: frozenset[str] = frozenset()
    code_of: Callable[[BaseException], str] = lambda exc: ""
    codes: Mapping[str, Failure] = field(default_factory=lambda: MappingProxyType({}))
    quiet_loggers: tuple[str, ...] = ()
    client_options: Callable[[dict[str, Any]], dict[str, Any]] = dict
    library_retries: int | None = None
    local: bool = False

    def classify(self, exc: BaseException) -> Failure | None:
        """What `exc` means, or None when it is not the store's failure (tierckpt's own
        errors, a bad request, a bug): the caller raises it as it is."""
        if isinstance(exc, PersistentTierUnavailable):
            return Failure.UNAVAILABLE
        if isinstance(exc, TierckptError):
            return None  # ChecksumMismatch is an OSError: damage, not an outage
        code = self.code_of(exc)
        if code:
            return self.codes.get(code, Failure.UNAVAILABLE)
        if isinstance(exc, FileNotFoundError):
            return Failure.MISSING
        if isinstance(exc, PermissionError):
            return Failure.DENIED
        if isinstance(exc, ConnectionError | TimeoutError):
            return Failure.TRANSIENT
        if isinstance(exc, _REQUEST_ERRORS):
            return None
        if isinstance(exc, OSError):  # s3fs: 5xx, SlowDown (EBUSY); a stale mount (ELOOP)
            return Failure.TRANSIENT
        if any(cls.__name__ in self.transient_names for cls in type(exc).__mro__):
            return Failure.TRANSIENT
        return None

    def is_transient(self, exc: BaseException) -> bool:
        """Whether retrying `exc` may succeed."""
        return self.classify(exc) is Failure.TRANSIENT

    def describe(self, exc: BaseException) -> str:
        """A short cause naming the store's error: "AccessDenied: ...", "connection
        refused: ...", "timeout: ...", following the exception chain to the first error
        that says more than "the retries ran out"."""
        seen: set[int] = set()
        chain: list[BaseException] = []
        e: BaseException | None = exc
        while e is not None and id(e) not in seen and len(chain) < 16:
            seen.add(id(e))
            chain.append(e)
            e = e.__cause__ or e.__context__
        for e in chain:
            text = str(e)[:_CAUSE_LIMIT]
            code = self.code_of(e)
            if code:
                return f"{code}: {text}"
            if isinstance(e, PermissionError):
                return f"AccessDenied: {text}"
            if isinstance(e, ConnectionRefusedError) or "refused" in text.lower():
                return f"connection refused: {text}"
            if isinstance(e, ConnectionError) and not isinstance(e, PersistentTierUnavailable):
                return f"connection failed: {text}"
            if isinstance(e, TimeoutError) or type(e).__name__.endswith("TimeoutError"):
                return f"timeout: {text}"
            if isinstance(e, OSError) and e.errno == errno.EBUSY:
                return f"SlowDown (throttled): {text}"
        last = chain[-1]
        return f"{type(last).__name__}: {str(last)[:_CAUSE_LIMIT]}"


# ---- S3 (s3fs over aiobotocore) -------------------------------------------------------


def _s3_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError (s3fs raises it untranslated at times)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if isinstance(code, str) and code:
            return code
    return ""


# botocore `Config` for an S3 root whose storage_options do not set these keys: one
# request waits at most connect_timeout + read_timeout per attempt, 2 attempts; the
# RetryPolicy retries the operation as a whole. botocore's legacy default of 5 attempts,
# times s3fs's 5 retries of a read timeout, held one call for over 6 minutes.
S3_CLIENT_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "connect_timeout": 5,
        "read_timeout": 15,
        "retries": {"total_max_attempts": 2, "mode": "standard"},
    }
)
S3_RETRIES = 2  # s3fs's own retries of a timeout or 5xx (its default is 5)


def _s3_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    options = dict(storage_options)
    config = dict(options.get("config_kwargs") or {})
    for key, value in S3_CLIENT_DEFAULTS.items():
        config.setdefault(key, value)
    options["config_kwargs"] = config
    return options


_S3_DENIED = (
    "AccessDenied",
    "AccountProblem",
    "AllAccessDisabled",
    "ExpiredToken",
    "InvalidAccessKeyId",
    "InvalidSecurity",
    "NotSignedUp",
    "RequestTimeTooSkewed",
    "SignatureDoesNotMatch",
    "403",
)
_S3_MISSING = ("NoSuchBucket", "NoSuchKey", "NoSuchUpload", "NoSuchVersion", "404")
_S3_TRANSIENT = (
    "InternalError",
    "OperationAborted",
    "RequestTimeout",
    "ServiceUnavailable",
    "SlowDown",
    "500",
    "503",
)

S3 = Backend(
    schemes=("s3", "s3a"),
    transient_names=frozenset(
        {
            "HTTPClientError",
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ConnectTimeoutError",
            "ReadTimeoutError",
            "ResponseStreamingError",
            "IncompleteReadError",
            "ClientPayloadError",
            "ServerDisconnectedError",
            "ClientConnectionError",
        }
    ),
    code_of=_s3_code,
    codes=MappingProxyType(
        {code: Failure.DENIED for code in _S3_DENIED}
        | {code: Failure.MISSING for code in _S3_MISSING}
        | {code: Failure.TRANSIENT for code in _S3_TRANSIENT}
    ),
    quiet_loggers=("botocore", "aiobotocore", "boto3", "s3fs", "urllib3"),
    client_options=_s3_options,
    library_retries=S3_RETRIES,
)

# ---- a directory on this node (local disk, NFS, a FUSE mount) -------------------------

FILE = Backend(schemes=("file", "local"), local=True)

# ---- any other fsspec URL (memory://, gcs://, ...): the builtins fsspec raises ---------

GENERIC = Backend(schemes=())

BACKENDS: Mapping[str, Backend] = MappingProxyType(
    {scheme: b for b in (S3, FILE) for scheme in b.schemes}
)

# Every backend's credential-leaking loggers, and fsspec's (every backend goes through it).
QUIET_LOGGERS: tuple[str, ...] = tuple(
    dict.fromkeys(name for b in BACKENDS.values() for name in (*b.quiet_loggers, "fsspec"))
)


def scheme_of(url: str) -> str:
    """The URL's scheme ("file" for a bare path, as fsspec reads one)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def backend_for(url: str) -> Backend:
    """The table entry for `url`'s scheme (`GENERIC` for one the table does not list)."""
    return BACKENDS.get(scheme_of(url), GENERIC)


def tier_label(url: str) -> str:
    """How errors sent to clients name the persistent tier: an object-store URL without its
    credentials ("persistent s3://bucket/prefix"), but a store on this node only by a
    short digest of its URL (the daemon's log names it in full). Distinct stores keep
    distinct labels."""
    if backend_for(url).local:
        return f"persistent file store {xxhash.xxh64_hexdigest(url.encode())[:8]}"
    return f"persistent {redact(url)}"
