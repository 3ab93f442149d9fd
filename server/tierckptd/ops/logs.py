"""The daemon's log formats: `[log] format = "text"` (one human line) or "json" (one
object per line, for log pipelines that index fields: Loki, CloudWatch, Elasticsearch).

A JSON line has ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``,
``node``, ``msg``, plus ``namespace``, ``checkpoint`` and ``rank`` when the call site
passed them (``logger.info(..., extra=context(ns, cid, rank))``), and ``exc`` with a
traceback. Newlines and control characters in a message are escaped by the encoder, so a
hostile name that reaches a message can never forge a second record.

Logging never shows secrets: the persistent backends' client libraries (their names come
from `persistent.errors.QUIET_LOGGERS`, passed in by the composition root) stay at INFO even
under `[log] level = "DEBUG"`, because botocore's DEBUG output carries request headers
(X-Amz-Security-Token, the access key id).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, Literal

__all__ = [
    "CONTEXT_FIELDS",
    "JsonFormatter",
    "context",
    "formatter",
    "set_log_format",
    "set_log_level",
    "setup_logging",
]

CONTEXT_FIELDS = ("namespace", "checkpoint", "rank")
TEXT_FORMAT = "%(asctime)s %(levelname)s [{node}] %(name)s: %(message)s"


def context(namespace: str, checkpoint_id: str = "", rank: int | None = None) -> dict[str, Any]:
    """The `extra=` of a log call about a checkpoint (JSON logs carry them as fields)."""
    fields: dict[str, Any] = {"namespace": namespace}
    if checkpoint_id:
        fields["checkpoint"] = checkpoint_id
    if rank is not None:
        fields["rank"] = rank
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per record, `node` in every one."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        ms = int(record.msecs)
        doc: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "node": self.node,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                doc[key] = value if isinstance(value, int | str) else str(value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str)


def formatter(kind: Literal["text", "json"] | str, node: str) -> logging.Formatter:
    """The formatter of `[log] format` (validated by the config loader)."""
    if kind == "json":
        return JsonFormatter(node)
    return logging.Formatter(TEXT_FORMAT.format(node=node))


class _QuietBelowInfo(logging.Filter):
    """Drops DEBUG records of the quiet loggers even if a library lowers its own level."""

    def __init__(self, quiet: Sequence[str]) -> None:
        super().__init__()
        self.quiet = frozenset(quiet)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.INFO or record.name.split(".", 1)[0] not in self.quiet


def set_log_level(level: str, quiet: Sequence[str]) -> None:
    """Set the root level, keeping the `quiet` loggers (their DEBUG records carry
    credentials) at INFO or above."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    for name in quiet:
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))


def set_log_format(kind: str, node: str) -> None:
    """`[log] format`: "text" lines or one JSON object per line."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter(kind, node))


def setup_logging(level: str, kind: str, node: str, quiet: Sequence[str]) -> None:
    """stderr logging (journald / kubectl logs) with the node id in every line; the
    `quiet` loggers never below INFO."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr)
    set_log_format(kind, node)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _QuietBelowInfo) for f in handler.filters):
            handler.addFilter(_QuietBelowInfo(quiet))
    set_log_level(level, quiet)
