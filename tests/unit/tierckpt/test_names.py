"""Grammar of namespaces, checkpoint ids and file names (names become path components)."""

from __future__ import annotations

import pytest
from tierckpt.errors import InvalidName, TierckptError
from tierckpt.names import (
    METADATA_FILE,
    check_checkpoint_id,
    check_file_name,
    check_namespace,
    check_new_checkpoint_id,
    step_of,
)

CHECKERS = {
    "namespace": check_namespace,
    "checkpoint id": check_checkpoint_id,
    "file name": check_file_name,
}

VALID = ["a", "step-000100", "llama3-70b_run.7", "A.b_c-9", "x" * 128, "...", ".hidden", "0"]
INVALID = [
    "",
    ".",
    "..",
    "../x",
    "a/..",
    "a/b",
    "/abs",
    "a\\b",
    "x" * 129,
    "caf\u00e9",
    "\u0661\u0662",  # arabic-indic digits: \d would accept them, the charset must not
    "a b",
    "a\n",  # `$`-style anchoring would accept a trailing newline
    "\nab",
    "a\x00b",
    "a:b",
    "*",
]
NOT_STR = [None, 5, b"abc", ["a"], 1.5]


@pytest.mark.parametrize("kind", CHECKERS)
@pytest.mark.parametrize("value", VALID)
def test_valid_names_are_returned_unchanged(kind: str, value: str) -> None:
    assert CHECKERS[kind](value) == value


@pytest.mark.parametrize("kind", CHECKERS)
@pytest.mark.parametrize("value", INVALID + NOT_STR)
def test_invalid_names_raise_invalid_name_stating_the_charset(kind: str, value: object) -> None:
    with pytest.raises(InvalidName) as info:
        CHECKERS[kind](value)
    err = info.value
    assert isinstance(err, ValueError)
    assert isinstance(err, TierckptError)
    message = str(err)
    assert "[A-Za-z0-9._-]" in message
    assert "1-128" in message
    assert kind in message
    assert repr(value) in message


def test_metadata_file_is_a_valid_file_name() -> None:
    assert check_file_name(METADATA_FILE) == ".metadata"


@pytest.mark.parametrize(
    ("checkpoint_id", "step"),
    [
        ("step-000100", 100),
        ("step-100", 100),
        ("step-0", 0),
        ("7", 7),
        ("v2-step-5", 5),
        ("run3.step12", 12),
        ("step-" + "9" * 30, int("9" * 30)),
    ],
)
def test_step_of_takes_the_trailing_integer(checkpoint_id: str, step: int) -> None:
    assert step_of(checkpoint_id) == step


@pytest.mark.parametrize("checkpoint_id", ["", "latest", "step-1a", "step-", "12-final"])
def test_step_of_is_none_without_trailing_integer(checkpoint_id: str) -> None:
    assert step_of(checkpoint_id) is None


@pytest.mark.parametrize("kind", sorted(CHECKERS))
def test_error_quotes_a_huge_name_bounded(kind: str) -> None:
    # Audit M5: a 5 MiB name must not become a 5 MiB error message or log line.
    with pytest.raises(InvalidName) as info:
        CHECKERS[kind]("x" * 5_000_000)
    message = str(info.value)
    assert len(message) < 300
    assert "5000002 characters" in message


def test_latest_is_reserved_for_new_checkpoints_only() -> None:
    # tierckpt://<namespace>/latest names the newest checkpoint: one saved as "latest"
    # could never be reached through a URL, so a new checkpoint may not take the id...
    with pytest.raises(InvalidName, match=r"'latest' is reserved.*newest committed"):
        check_new_checkpoint_id("latest")
    assert check_new_checkpoint_id("latest-100") == "latest-100"
    assert check_new_checkpoint_id("Latest") == "Latest"
    # ...while reading, listing and deleting still accept it (a checkpoint an older
    # version saved under that id stays reachable natively).
    assert check_checkpoint_id("latest") == "latest"
    with pytest.raises(InvalidName, match="checkpoint id"):
        check_new_checkpoint_id("../latest")
