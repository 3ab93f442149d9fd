"""Grammar of namespaces, checkpoint ids and DCP file names.

Names become path components in the memory tier and keys under an fsspec URL, so the
charset is narrow and `.`/`..` are refused: a name can never escape its directory.
Checkpoint ids may also hold `=`, because frameworks name checkpoints that way
(Lightning's ``epoch=0-step=100``); `=` is an ordinary character in a path component and
an S3 key, never a separator, so it opens no path trick. Namespaces and file names keep
the narrower set.

A checkpoint id may be a folder path (``run1/step-10``: up to 8 segments joined by "/",
each segment the id grammar, at most 200 characters in all), so users write folders as
they would locally; the namespace stays one segment. Where an id must be one path
component (the memory tier's directories and manifests, the persistent tier's
bookkeeping), `flat_checkpoint_id` spells "/" as "+", a character no segment holds, so
the spelling is reversible (`checkpoint_id_of_flat`). 200 characters leave room for the
memory tier's longest derived name (``.<id>.json.tmp-<16 hex>``) within NAME_MAX (255).
"""

from __future__ import annotations

import re

from tierckpt.errors import InvalidName

__all__ = [
    "FORMATS",
    "FORMAT_DCP",
    "FORMAT_FILES",
    "LATEST",
    "LATEST_VERIFIED",
    "NEXT_GENERATION",
    "MAX_ID",
    "MAX_ID_SEGMENTS",
    "METADATA_FILE",
    "check_checkpoint_id",
    "check_file_name",
    "check_format",
    "check_namespace",
    "check_new_checkpoint_id",
    "check_persistent_url",
    "checkpoint_id_of_flat",
    "flat_checkpoint_id",
    "is_checkpoint_id",
    "next_generation_id",
    "step_of",
]

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_CHECKPOINT_ID = re.compile(r"[A-Za-z0-9._=-]{1,128}")  # one segment of an id
MAX_ID_SEGMENTS = 8
MAX_ID = 200
FOLDER_SEPARATOR = "/"
FLAT_SEPARATOR = "+"  # outside the segment grammar: the flat spelling is reversible
_STEP = re.compile(r"(\d+)$")
_URL = re.compile(r"([a-z][a-z0-9+.-]{0,31})://(/?)([^/].*?)/*")
_URL_SEGMENT = re.compile(r"[A-Za-z0-9._~=:+-]{1,255}")
MAX_URL = 1024
METADATA_FILE = ".metadata"
# A checkpoint's format: DCP (`.metadata` names its data files and commits it), or any
# other format's set of files, which tierckpt holds and moves byte for byte, never decodes.
FORMAT_DCP = "dcp"
FORMAT_FILES = "files"
FORMATS = (FORMAT_DCP, FORMAT_FILES)
# Ends the daemon's internal id of a save that replaces a committed checkpoint (an
# overwrite): "~" is outside the id grammar, so no user id spells it, no RPC reaches it,
# and a memory-tier directory named so is never adopted (a restart collects it).
NEXT_GENERATION = "~next"
# In a `tierckpt://<namespace>/latest` URL: the newest committed checkpoint of the namespace.
LATEST = "latest"
# In a `tierckpt://<namespace>/latest-verified` URL: the newest one marked verified.
LATEST_VERIFIED = "latest-verified"


def _shown(value: object) -> str:
    """`value` as an error message quotes it: bounded, whatever a caller sent."""
    text = repr(value)
    return text if len(text) <= 160 else f"{text[:64]}... ({len(text)} characters)"


def _check(kind: str, value: object, grammar: re.Pattern[str] = _NAME, extra: str = "") -> str:
    if not isinstance(value, str) or not grammar.fullmatch(value) or value in (".", ".."):
        raise InvalidName(
            f"invalid {kind} {_shown(value)}: use 1-128 characters from [A-Za-z0-9._-]"
            f"{extra}, not '.' or '..'"
        )
    return value


def check_namespace(value: object) -> str:
    """Return `value` if it is a valid namespace (one training job), else raise InvalidName."""
    return _check("namespace", value)


def check_checkpoint_id(value: object) -> str:
    """Return `value` if it is a valid checkpoint id (``step-000100``, ``epoch=0-step=100``,
    ``run1/step-10``), else raise InvalidName.

    A folder path's segments may not start with "." (no hidden folders: ``.tierckpt`` is
    the persistent tier's bookkeeping), so a nested id never reaches tierckpt's own keys;
    a one-segment id keeps the older grammar."""
    if not isinstance(value, str) or FOLDER_SEPARATOR not in value:
        return _check("checkpoint id", value, _CHECKPOINT_ID, " and '='")
    segments = value.split(FOLDER_SEPARATOR)
    if not (
        len(value) <= MAX_ID
        and len(segments) <= MAX_ID_SEGMENTS
        and all(_CHECKPOINT_ID.fullmatch(s) and not s.startswith(".") for s in segments)
    ):
        raise InvalidName(
            f"invalid checkpoint id {_shown(value)}: a folder path is 1-{MAX_ID_SEGMENTS} "
            "segments joined by '/', each 1-128 characters from [A-Za-z0-9._-] and '=', not "
            f"starting with '.', no empty segment, at most {MAX_ID} characters in all"
        )
    return value


def flat_checkpoint_id(checkpoint_id: str) -> str:
    """`checkpoint_id` as one path component ("/" spelled "+"); one-segment ids unchanged."""
    return check_checkpoint_id(checkpoint_id).replace(FOLDER_SEPARATOR, FLAT_SEPARATOR)


def next_generation_id(checkpoint_id: str) -> str:
    """The internal id under which a save replacing the committed `checkpoint_id` is
    written until it commits (`NEXT_GENERATION`)."""
    return check_checkpoint_id(checkpoint_id) + NEXT_GENERATION


def checkpoint_id_of_flat(name: object) -> str:
    """The checkpoint id a `flat_checkpoint_id` name spells, validated (InvalidName)."""
    if not isinstance(name, str) or FOLDER_SEPARATOR in name:
        raise InvalidName(f"invalid flat checkpoint id {_shown(name)}: one path component")
    return check_checkpoint_id(name.replace(FLAT_SEPARATOR, FOLDER_SEPARATOR))


def check_new_checkpoint_id(value: object) -> str:
    """`check_checkpoint_id` for a checkpoint about to be created, which may not take an id
    that `tierckpt://` URLs reserve: saved as ``latest``, it could never be reached there."""
    checkpoint_id = check_checkpoint_id(value)
    if checkpoint_id in (LATEST, LATEST_VERIFIED):
        raise InvalidName(
            f"checkpoint id {checkpoint_id!r} is reserved: tierckpt://<namespace>/"
            f"{checkpoint_id} names the newest committed (or verified) checkpoint; save under "
            "another id (step-000100)"
        )
    return checkpoint_id


def is_checkpoint_id(value: object) -> bool:
    """Whether `value` (str or path-like) is a valid checkpoint id; DCP's validate hook."""
    try:
        check_checkpoint_id(str(value))
    except InvalidName:
        return False
    return True


def check_file_name(value: object) -> str:
    """Return `value` if it is a valid DCP file name of a checkpoint, else raise InvalidName."""
    return _check("file name", value)


def check_format(value: object) -> str:
    """The checkpoint format `value` names ("" is DCP, the default), else InvalidName."""
    if value == "":
        return FORMAT_DCP
    if not isinstance(value, str) or value not in FORMATS:
        raise InvalidName(
            f"invalid checkpoint format {_shown(value)}: use {' or '.join(map(repr, FORMATS))}"
        )
    return value


def step_of(checkpoint_id: str) -> int | None:
    """The step of a checkpoint id: its trailing integer (``step-000100`` -> 100), if any."""
    match = _STEP.search(checkpoint_id)
    return int(match.group(1)) if match else None


def check_persistent_url(value: object) -> str:
    """`value` normalized if it is a persistent-tier URL a namespace may drain to ("" is
    the daemon's own `[persistent] url`), else raise InvalidName.

    The URL becomes an fsspec root and travels in manifests between nodes, so the grammar
    is narrow: ``scheme://segment/segment...`` (``file:///abs/path`` too), segments from
    [A-Za-z0-9._~=:+-] (no ``user@host``: credentials never travel in a URL) and never empty, `.` or `..`; no query, fragment, percent-escape
    or whitespace, at most 1024 characters. Trailing slashes are dropped, so one place has
    one spelling and prefix checks compare whole segments.
    """
    if value == "":
        return ""
    match = _URL.fullmatch(value) if isinstance(value, str) and len(value) <= MAX_URL else None
    segments = match.group(3).split("/") if match else []
    if match is None or not all(
        _URL_SEGMENT.fullmatch(s) and s not in (".", "..") for s in segments
    ):
        raise InvalidName(
            f"invalid persistent URL {_shown(value)}: use scheme://bucket/prefix (or "
            "file:///abs/dir), path segments from [A-Za-z0-9._~=:+-], no '.', '..' or empty "
            "segment, no '?', '#', '%' or spaces, at most 1024 characters"
        )
    scheme, slash = match.group(1), match.group(2)
    return f"{scheme}://{slash}{'/'.join(segments)}"
