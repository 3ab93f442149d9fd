"""Secrets in the configuration never reach a log line: redaction, SIGHUP diffs, and the
warning for a config file that holds credentials other users can read.

Storage options and URLs may carry S3 keys or STS tokens; everything the daemon logs
about its config goes through `redact`, which hides values by key name (secret, token,
key, password, credential, ...) and drops user:password@ from URLs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path

from tierckptd.config import Config

__all__ = ["REDACTED", "config_changes", "config_file_warnings", "redact"]

REDACTED = "<redacted>"
_SECRET_KEY = re.compile(
    r"secret|token|key|passw|credential|connection_string|sas_|signature|auth", re.IGNORECASE
)
# These hold paths to secrets, not secrets: showing them helps and leaks nothing.
_PATH_KEYS = frozenset(
    {"security.token_file", "security.tls_cert", "security.tls_key", "security.tls_ca"}
)
_URL_USERINFO = re.compile(r"(//)[^/@\s]+@")


def _is_secret(path: str) -> bool:
    return path not in _PATH_KEYS and bool(_SECRET_KEY.search(path.rsplit(".", 1)[-1]))


def redact(value: object, key: str = "") -> object:
    """`value` with every secret-looking entry (by key name: secret, token, key, password,
    credential, ...) replaced by "<redacted>", and user:password@ dropped from URLs."""
    if key and _is_secret(key):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str):
        return _URL_USERINFO.sub(r"\1<redacted>@", value)
    return value


def _holds_credentials(config: Config) -> bool:
    def walk(value: object, key: str) -> bool:
        if key and _is_secret(key) and value not in ("", None, {}, []):
            return True
        if isinstance(value, dict):
            return any(walk(v, str(k)) for k, v in value.items())
        return False

    url = config.persistent.url
    return walk(config.persistent.storage_options, "") or redact(url) != url


def config_file_warnings(path: str | Path, config: Config) -> list[str]:
    """A warning when the config file holds credentials that other users can read."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return []
    if not (mode & 0o044) or not _holds_credentials(config):
        return []
    who = "every user" if mode & 0o004 else "its group"
    return [
        f"config file {path} holds credentials ([persistent] storage_options or url) and is "
        f"readable by {who} (mode {mode:04o}): chmod 600 it, owned by the daemon's user, or "
        "on Kubernetes mount it from a Secret; better, give S3 credentials through the "
        "environment, IRSA / instance metadata, or systemd LoadCredential="
    ]


def _flatten(value: object, prefix: str) -> dict[str, object]:
    """Dotted keys to leaf values; tables (storage_options) are flattened too, so a diff
    names the one option that changed."""
    path = prefix.rstrip(".")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, object] = {}
        for f in dataclasses.fields(value):
            out.update(_flatten(getattr(value, f.name), f"{prefix}{f.name}."))
        return out
    if isinstance(value, dict) and value and not _is_secret(path):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {path: value}


_UNSET = object()


def _show(key: str, value: object) -> str:
    if value is _UNSET:
        return "(unset)"
    shown = redact(value, key)
    return REDACTED if shown == REDACTED else repr(shown)


def config_changes(old: Config, new: Config) -> list[str]:
    """Human-readable "key: old -> new" lines, logged on SIGHUP; secrets are redacted."""
    a, b = _flatten(old, ""), _flatten(new, "")
    return [
        f"{k}: {_show(k, a.get(k, _UNSET))} -> {_show(k, b.get(k, _UNSET))}"
        for k in sorted(set(a) | set(b))
        if a.get(k, _UNSET) != b.get(k, _UNSET)
    ]
