"""The SageMaker client's wire vocabulary, validated where it enters: routes, names,
ranks, steps, queries and the ``Shard-Meta`` header (xxh3-128 of a blob).

Nothing from a request reaches the daemon before it passes here: a namespace is a
tierckpt namespace (`tierckpt.names`), ranks and steps are bounded decimal integers,
and a target in absolute form (``http://host:port/path``, what a client behind
``HTTP_PROXY`` sends) is reduced to its path.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from tierckpt.errors import InvalidArgument
from tierckpt.names import check_namespace

from tierckptd.model import MAX_NAMESPACE_KEEP_LAST

__all__ = [
    "ALGORITHM",
    "MAX_RANK",
    "MAX_STEP",
    "Route",
    "Target",
    "checkpoint_id_of",
    "data_file",
    "metadata_file",
    "metadata_rank",
    "parse_shard_meta",
    "parse_target",
    "shard_meta",
    "step_of",
]

ALGORITHM = "xxh3_128"  # the client's name for it (tierckpt's is "xxh3-128")
MAX_RANK = 1 << 20  # far beyond any job; keeps file names and lists small
MAX_STEP = 2**63 - 1
MAX_LIMIT = 1000
DEFAULT_LIMIT = 5
DEFAULT_STEPS_RETAINED = 3
_INT = re.compile(r"[0-9]{1,19}")
_MAX_TARGET = 2048
_METADATA = re.compile(r"\.sagemaker_metadata_([0-9]{1,7})")
MAX_STEPS_RETAINED = MAX_NAMESPACE_KEEP_LAST  # the memory window a manifest may carry
_STEP_ID = re.compile(r"step_([0-9]{1,19})")


class Route(enum.Enum):
    NAMESPACE = "namespace"  # /v1/cp/namespaces/{ns}
    BLOB = "blob"  # /v1/cp/checkpoints/{ns}/{rank}/{step}
    LATEST = "latest"  # /v1/cp/checkpoints/{ns}/latest
    RESET = "reset"  # /v1/cp/cluster/reset
    HEALTH = "health"  # /health (the stand-in's; the client never calls it)


@dataclass(frozen=True)
class Target:
    route: Route
    namespace: str = ""
    rank: int = 0
    step: int = 0
    query: dict[str, str] | None = None


class NoRoute(InvalidArgument):
    """No route of the API has this path (404)."""


def _integer(value: str, what: str, limit: int) -> int:
    if not _INT.fullmatch(value) or int(value) > limit:
        raise InvalidArgument(
            f"{what} must be a decimal integer from 0 to {limit}, got {value[:32]!r}"
        )
    return int(value)


def parse_target(target: str) -> Target:
    """The route a request target names, its parts validated."""
    if len(target) > _MAX_TARGET:
        raise InvalidArgument(f"the request target is longer than {_MAX_TARGET} characters")
    parts = urlsplit(target)  # absolute form: scheme and authority dropped
    segments = parts.path.split("/")
    if segments[:1] != [""]:
        raise NoRoute("the request target is not a path")
    segments = segments[1:]
    query = {k: v[-1] for k, v in parse_qs(parts.query, max_num_fields=8).items()}
    match segments:
        case ["health"]:
            return Target(Route.HEALTH)
        case ["v1", "cp", "namespaces", ns]:
            return Target(Route.NAMESPACE, check_namespace(ns), query=query)
        case ["v1", "cp", "checkpoints", ns, "latest"]:
            return Target(Route.LATEST, check_namespace(ns), query=query)
        case ["v1", "cp", "checkpoints", ns, rank, step]:
            return Target(
                Route.BLOB,
                check_namespace(ns),
                rank=_integer(rank, "the rank", MAX_RANK - 1),
                step=_integer(step, "the step", MAX_STEP),
            )
        case ["v1", "cp", "cluster", "reset"]:
            return Target(Route.RESET)
    raise NoRoute(
        f"no route {parts.path[:128]!r}; the API serves /v1/cp/namespaces/NS, "
        "/v1/cp/checkpoints/NS/RANK/STEP, /v1/cp/checkpoints/NS/latest"
    )


def query_int(query: dict[str, str] | None, key: str, default: int, low: int, high: int) -> int:
    """A bounded integer query parameter (`default` when absent)."""
    raw = (query or {}).get(key)
    if raw is None:
        return default
    value = _integer(raw, f"query parameter {key}", high)
    if value < low:
        raise InvalidArgument(f"query parameter {key} must be at least {low}, got {value}")
    return value


def parse_shard_meta(header: str | None) -> bytes:
    """The 16-byte xxh3-128 digest a ``Shard-Meta`` header carries (InvalidArgument
    when missing or malformed: a blob without it could never be read back)."""
    if header is None:
        raise InvalidArgument(
            'the Shard-Meta header is missing: send {"checksum": "<base64 xxh3-128>", '
            '"algorithm": "xxh3_128"} with every blob'
        )
    if len(header) > 512:
        raise InvalidArgument("the Shard-Meta header is longer than 512 characters")
    try:
        doc = json.loads(header)
        checksum = doc["checksum"]
        algorithm = doc.get("algorithm", ALGORITHM)
        digest = base64.b64decode(checksum, validate=True)
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        raise InvalidArgument(
            "the Shard-Meta header is not a JSON object with a base64 checksum"
        ) from None
    if algorithm != ALGORITHM or len(digest) != 16:
        raise InvalidArgument(
            f"Shard-Meta: only {ALGORITHM} checksums (16 bytes) are taken, got "
            f"{str(algorithm)[:32]!r} with {len(digest)} bytes"
        )
    return digest


def shard_meta(digest: bytes) -> str:
    """The ``Shard-Meta`` header of a blob whose xxh3-128 digest is `digest`."""
    return json.dumps({"checksum": base64.b64encode(digest).decode(), "algorithm": ALGORITHM})


def checkpoint_id_of(step: int) -> str:
    """Step N is tierckpt checkpoint ``step_N`` (as `tierckpt.compat.sagemaker`)."""
    return f"step_{step}"


def step_of(checkpoint_id: str) -> int | None:
    match = _STEP_ID.fullmatch(checkpoint_id)
    return int(match.group(1)) if match is not None and int(match.group(1)) <= MAX_STEP else None


def data_file(rank: int) -> str:
    """Data rank R's blob: the stock DCP file ``__R_0.distcp``, byte for byte."""
    return f"__{rank}_0.distcp"


def metadata_file(rank: int) -> str:
    """The client's metadata blob (its rank is ``world_size``), kept byte-exact beside the
    stock `.metadata` made from it; the name records the rank it is served under."""
    return f".sagemaker_metadata_{rank}"


def metadata_rank(name: str) -> int | None:
    """The rank of a `metadata_file` name, else None."""
    match = _METADATA.fullmatch(name)
    return int(match.group(1)) if match is not None else None
