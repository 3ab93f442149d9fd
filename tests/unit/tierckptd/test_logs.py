"""`[log] format = "json"`: one object per line with the fixed fields and the checkpoint
context a call site passes; the text format is unchanged."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from tierckptd.ops import logs


@pytest.fixture
def capture() -> Iterator[tuple[logging.Logger, logging.StreamHandler[io.StringIO]]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("tierckptd.test_logs")
    log.propagate = False
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    try:
        yield log, handler
    finally:
        log.removeHandler(handler)
        log.propagate = True


def _lines(handler: logging.StreamHandler[io.StringIO]) -> list[str]:
    return handler.stream.getvalue().splitlines()


def test_json_lines_carry_the_fields_and_the_context(
    capture: tuple[logging.Logger, logging.StreamHandler[io.StringIO]],
) -> None:
    log, handler = capture
    handler.setFormatter(logs.formatter("json", "node-a"))
    log.info("committed %s/%s", "run", "step-1", extra=logs.context("run", "step-1", 3))
    log.warning("no context here")
    first, second = (json.loads(line) for line in _lines(handler))
    assert first["level"] == "INFO" and second["level"] == "WARNING"
    assert first["logger"] == "tierckptd.test_logs"
    assert first["node"] == "node-a"
    assert first["msg"] == "committed run/step-1"
    assert (first["namespace"], first["checkpoint"], first["rank"]) == ("run", "step-1", 3)
    assert first["time"].endswith("Z") and "T" in first["time"]
    assert not {"namespace", "checkpoint", "rank"} & second.keys()


def test_a_hostile_message_stays_one_record(
    capture: tuple[logging.Logger, logging.StreamHandler[io.StringIO]],
) -> None:
    """A newline in a message (a name that reached it) cannot forge a second record."""
    log, handler = capture
    handler.setFormatter(logs.formatter("json", "node-a"))
    forged = 'x\n{"level": "INFO", "msg": "forged"}\r\x1b[2K'
    log.error("refused %s", forged, extra=logs.context(forged))
    lines = _lines(handler)
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["msg"] == f"refused {forged}" and record["namespace"] == forged


def test_tracebacks_go_into_one_field(
    capture: tuple[logging.Logger, logging.StreamHandler[io.StringIO]],
) -> None:
    log, handler = capture
    handler.setFormatter(logs.formatter("json", "node-a"))
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("drain failed")
    (line,) = _lines(handler)
    record = json.loads(line)
    assert record["level"] == "ERROR"
    assert "ValueError: boom" in record["exc"]


def test_text_format_keeps_the_node_in_every_line(
    capture: tuple[logging.Logger, logging.StreamHandler[io.StringIO]],
) -> None:
    log, handler = capture
    handler.setFormatter(logs.formatter("text", "node-a"))
    log.info("ready", extra=logs.context("run"))
    (line,) = _lines(handler)
    assert " INFO [node-a] tierckptd.test_logs: ready" in line
